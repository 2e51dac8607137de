"""What the engine hands back: vLLM's ``RequestOutput`` / ``CompletionOutput`` / ``Logprob``, and
``FirstTokenTimes``, where a request's time to its first token went inside the engine.

Outputs are cumulative, as vLLM's default: each streamed ``RequestOutput`` holds the whole text
and token ids so far; a streaming client takes the part after what it has already sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.engine.lora.request import LoRARequest


@dataclass
class Logprob:
    """Log-probability of one token; ``rank`` is 1 for the most likely token."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion. ``finish_reason``: ``"stop"`` (EOS, stop token or stop string),
    ``"length"`` (max_tokens or the context end), ``"abort"``, or None while running.
    ``stop_reason``: the stop string or stop token id that ended it (None for EOS)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class FirstTokenTimes:
    """A request's way to its first token inside the engine, for the worker's TTFT breakdown
    (serving.engine.server.metrics: loraplex_request_*_seconds), stamped a few times per request,
    never per token.

    The engine may run in another process than the HTTP layer (``ProcessEngine``), whose monotonic
    clock readings this one could not be compared with in general. So the two phases inside the
    engine travel as durations on its own monotonic clock (immune to steps of the wall clock), and
    the two points the HTTP layer measures its phases against (admission: from its arrival to
    ``added_ns``; delivery: from ``first_token_ns`` to its first token sent) are wall-clock
    readings, one clock for every process of the machine, in integer nanoseconds (a float
    ``time.time()`` is only good to 0.24 µs today). Each of those is read right beside the
    monotonic reading its phase starts or ends at, in the order that leaves the gap between the two
    reads outside every phase (the wall clock first at the add, the monotonic one first at the
    token; the HTTP layer does the like at its two ends), so the four phases add up to at most the
    TTFT the HTTP layer measures, whatever runs between the two reads; only a step of the wall
    clock (NTP setting the time, not slewing it) between a request's arrival and its first token
    could break that, and shows as one odd observation."""

    added_ns: int  # time.time_ns() when the engine took the request (LLMEngine.add_request)
    # Seconds from then to the step that first scheduled its prompt: the wait for its grammar's
    # compile, its adapter's load and its turn in the queue.
    queue: float
    # Seconds from that step to its first token read by the host: the prompt's steps (several for a
    # chunked prefill), a preemption before the first token, and under async scheduling the launch of
    # the next step before the token is read.
    prefill: float
    first_token_ns: int  # time.time_ns() when the host read its first token, before its output was made


@dataclass
class RequestOutput:
    """Everything known about one request so far (cumulative). ``error`` (beyond vLLM's fields)
    is set when the request could not be served, e.g. its adapter failed to load."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    lora_request: LoRARequest | None = None
    error: Exception | None = None
    # With SamplingParams.prompt_logprobs: per prompt token (None for the first), as vLLM.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # vLLM's: prompt tokens the prefix cache held when the request was admitted (None: caching off).
    num_cached_tokens: int | None = None
    # Tokens generated so far over all the request's sequences, those a ``best_of > n`` request
    # discards included: what its usage charges (OpenAI bills best_of's every token).
    num_generated_tokens: int = 0
    # Set once its first token is read (on every output from then on); None before.
    first_token_times: FirstTokenTimes | None = None
