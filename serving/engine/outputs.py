"""What the engine hands back: vLLM's ``RequestOutput`` / ``CompletionOutput`` / ``Logprob``.

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
