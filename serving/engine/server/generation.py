"""Running one HTTP generation request on the engine, shared by completions and chat.

completions.py and chat.py build a `GenerationRequest` once from the parsed body; `Generation`
runs it: the model name resolved to an adapter, the fields checked, the prompt built, sampling
parameters checked against the context, admission, the engine's cumulative outputs turned into
deltas, latency metrics, and abort when the client leaves.

A request's whole life is one async generator (`Generation._lifetime`), so how it ended is decided
and recorded once, in that generator's `finally` (loraplex_requests_total, and the request's access
line: model, outcome, tokens, the completion's id beside the gateway's request id): an error raised
on the way names the status, the engine's last output names it otherwise, and a request closed or
cancelled before the engine finished it was aborted.

The first delta is awaited before any response is sent, so errors the engine raises at the start
(a bad prompt, an adapter that cannot be loaded) become proper HTTP errors, also for streams.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import Request

from serving.engine import (
    AdapterError,
    AdapterNotFoundError,
    AsyncEngine,
    EngineDeadError,
    Logprob,
    LoRARequest,
    RequestOutput,
    SamplingParams,
    SlotCorruptedError,
)
from serving.engine.detokenizer import decode_text
from serving.engine.guided import GrammarError, GuidedDecodingParams
from serving.engine.server import metrics as outcomes
from serving.engine.server.adapters import AdapterSet
from serving.engine.server.errors import APIError, bad_request, model_not_found, slot_corrupted
from serving.engine.server.on_demand import ensure_loaded
from serving.engine.server.protocol import SamplingFields, UsageInfo
from serving.engine.server.worker import Worker
from serving.wire.access_log import access_note
from serving.wire.registry import SLOT_CORRUPTED

T = TypeVar("T")

# The prompt's token ids, from the ready engine (its tokenizer).
PromptBuilder = Callable[[AsyncEngine], Awaitable[list[int]]]


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


@dataclass(frozen=True)
class GenerationRequest:
    """One generation request as the engine is asked it, built once from the parsed HTTP body."""

    kind: str  # the request id's prefix: "cmpl", "chatcmpl"
    body: SamplingFields
    logprobs: int | None  # most likely tokens to report per position; None: no logprobs
    # Called only once the model and the fields are known good, so those errors come first.
    prompt: PromptBuilder

    @property
    def model(self) -> str:
        return self.body.model


@dataclass
class Delta:
    """What one engine output adds to the response."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0

    def info(self) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
        )


def resolve_model(adapters: AdapterSet, base_model_ids: list[str], model: str) -> LoRARequest | None:
    """None for the base model, the adapter's request for a loaded adapter name, else 404."""
    if model in base_model_ids:
        return None
    if adapters.get(model) is None:
        raise model_not_found(model)
    return LoRARequest(model)


def check_supported(body: SamplingFields) -> None:
    unsupported = body.unsupported_fields()
    if unsupported:
        raise bad_request(
            f"This worker does not support {', '.join(unsupported)}; leave "
            f"{'it' if len(unsupported) == 1 else 'them'} unset or at the default.",
            param=unsupported[0],
        )


def guided_decoding(body: SamplingFields) -> GuidedDecodingParams | None:
    """The structured-output constraint `body` asks for, if any; a 400 naming the field for two
    constraints or one that is malformed (one the grammar library refuses is found when compiled)."""
    constraints = body.constraints()
    if not constraints:
        return None
    if len(constraints) > 1:
        names = [name for name, _ in constraints]
        raise bad_request(f"{' and '.join(names)} each constrain the output; send one of them", param=names[1])
    name, fields = constraints[0]
    try:
        return GuidedDecodingParams(**fields)
    except ValueError as exc:
        raise bad_request(f"{name}: {exc}", param=name) from exc


def sampling_params(body: SamplingFields, *, prompt_len: int, max_model_len: int, logprobs: int | None) -> SamplingParams:
    """The engine's SamplingParams for `body`; every invalid value is a 400 that names it."""
    max_tokens = _max_tokens(body.max_tokens, prompt_len, max_model_len)
    guided = guided_decoding(body)
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=body.seed,
            max_tokens=max_tokens,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens,
            guided_decoding=guided,
        )
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc)) from exc


def _max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    """As asked if it fits the context; everything left if not asked (as vLLM); else a 400 with the
    figures, in OpenAI's wording."""
    if prompt_len >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt is "
            f"{prompt_len} tokens, which leaves no room for a completion. Please shorten the prompt.",
            code="context_length_exceeded",
        )
    if requested is None:
        return max_model_len - prompt_len
    if prompt_len + requested > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the completion). "
            "Please reduce the length of the prompt or of max_tokens.",
            param="max_tokens", code="context_length_exceeded",
        )
    return requested


async def until_disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the request body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client goes away first (then ClientDisconnected)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnected()


class Generation:
    """One generation request from its arrival to its end, yielding deltas.

    However it ends — the last token, an error, the client leaving (the stream is cancelled or
    closed), the worker draining — `_lifetime`'s `finally` aborts the engine request if it is
    unfinished, so its KV blocks and adapter slot are freed at once, releases its admission,
    counts its tokens and records the outcome. The owner of a started generation calls `aclose()`
    when the response ends (idempotent).
    """

    def __init__(self, worker: Worker, request: Request, job: GenerationRequest) -> None:
        self._worker = worker
        self._request = request
        self.job = job
        self.request_id = f"{job.kind}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        # Set once the prompt is built (before the first delta).
        self.prompt_token_ids: list[int] = []
        self.usage = Usage(prompt_tokens=0)
        self.finished = False
        self._engine: AsyncEngine | None = None
        self._arrival = time.perf_counter()
        self._last_token_at: float | None = None
        self._text_sent = 0
        self._tokens_sent = 0
        self._events = self._lifetime()

    @classmethod
    async def start(cls, worker: Worker, request: Request, job: GenerationRequest) -> tuple[Generation, Delta]:
        """Check, admit and run `job` up to its first delta (or the HTTP error that prevents one)."""
        generation = cls(worker, request, job)
        # _lifetime yields at least once or raises.
        return generation, await anext(generation._events)

    def decode(self, token_ids: list[int]) -> str:
        """Text of tokens (for logprobs), usable to the end of the stream, draining included."""
        if self._engine is None:
            raise RuntimeError("decode() before the generation started")
        return decode_text(self._engine.tokenizer, token_ids, skip_special_tokens=False)

    async def next(self) -> Delta | None:
        """The next delta, or None after the last one."""
        return await anext(self._events, None)

    async def aclose(self) -> None:
        """End the request now if it has not ended (it counts as aborted unless the engine
        finished it). Does not wait: nothing in `_lifetime`'s `finally` suspends."""
        await self._events.aclose()

    async def collect(self, first: Delta) -> list[Delta]:
        """The whole output, `first` included, for a reply that is not streamed, aborting if the
        client leaves meanwhile; ends the generation however it ends."""

        async def rest() -> list[Delta]:
            return [delta async for delta in self._deltas()]

        try:
            return [first, *await unless_disconnected(self._request, rest())]
        finally:
            await self.aclose()

    async def _deltas(self) -> AsyncIterator[Delta]:
        while (delta := await self.next()) is not None:
            yield delta

    async def _lifetime(self) -> AsyncGenerator[Delta, None]:
        job, worker = self.job, self._worker
        status = outcomes.ABORTED  # closed or cancelled before the engine finished it
        admitted = False
        try:
            engine, adapters = worker.require_ready()
            self._engine = engine
            await ensure_loaded(worker, adapters, job.body)
            lora_request = resolve_model(adapters, worker.base_model_ids, job.model)
            check_supported(job.body)
            self.prompt_token_ids = await job.prompt(engine)
            self.usage = Usage(prompt_tokens=len(self.prompt_token_ids))
            params = sampling_params(job.body, prompt_len=len(self.prompt_token_ids),
                                     max_model_len=engine.max_model_len, logprobs=job.logprobs)
            worker.admit(self.request_id)
            admitted = True
            outputs = engine.generate(
                {"prompt_token_ids": self.prompt_token_ids}, params, self.request_id,
                lora_request=lora_request, priority=job.body.priority,
            )
            output: RequestOutput | None = await self._first_output(outputs)
            while output is not None:
                delta = self._delta(output)
                if output.finished:
                    status = outcomes.ABORTED if delta.finish_reason == "abort" else outcomes.OK
                yield delta
                if self.finished:
                    return
                output = await _next_output(outputs)
        except BaseException as exc:
            if not self.finished:  # a close after the last delta changes nothing
                status = _status(exc)
            raise
        finally:
            if admitted:
                if not self.finished:
                    worker.abort_soon(self.request_id)
                worker.metrics.prompt_tokens.labels(job.model).inc(self.usage.prompt_tokens)
                worker.metrics.generation_tokens.labels(job.model).inc(self.usage.completion_tokens)
                worker.release(self.request_id)
            worker.metrics.requests.labels(job.model, status).inc()
            access_note(model=job.model, outcome=status, prompt_tokens=self.usage.prompt_tokens,
                        completion_tokens=self.usage.completion_tokens, completion_id=self.request_id)

    async def _first_output(self, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
        """The engine's first output, as the HTTP error for what prevents one."""
        try:
            first = await unless_disconnected(self._request, anext(outputs, None))
        except GrammarError as exc:
            constraints = self.job.body.constraints()
            raise bad_request(str(exc), param=constraints[0][0] if constraints else None) from exc
        except BaseException as exc:
            error = _as_api_error(exc)
            if error is exc:
                raise
            raise error from exc
        if first is None:
            raise APIError(500, "The engine ended the request without output.")
        return first

    def _delta(self, output: RequestOutput) -> Delta:
        """What `output` adds to what was sent; observes the latency metrics."""
        metrics = self._worker.metrics
        completion = output.outputs[0]
        new_ids = completion.token_ids[self._tokens_sent:]
        now = time.perf_counter()
        if new_ids:
            if self._last_token_at is None:
                metrics.ttft.observe(now - self._arrival)
            else:
                # Outputs a lagging reader coalesced share the gap evenly.
                gap = (now - self._last_token_at) / len(new_ids)
                for _ in new_ids:
                    metrics.itl.observe(gap)
            self._last_token_at = now
        delta = Delta(
            text=completion.text[self._text_sent:],
            token_ids=list(new_ids),
            logprobs=completion.logprobs[self._tokens_sent:] if completion.logprobs is not None else None,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
        self._text_sent = len(completion.text)
        self._tokens_sent = len(completion.token_ids)
        self.usage.completion_tokens = self._tokens_sent
        if output.finished:
            self.finished = True
            metrics.e2e.observe(now - self._arrival)
        return delta


async def _next_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    """The engine's next output; a request stopped on a corrupted slot as its HTTP error (a stream
    sends it as its error event, a whole reply as its status)."""
    try:
        return await anext(outputs, None)
    except SlotCorruptedError as exc:
        raise slot_corrupted(str(exc)) from exc


_STATUS_OF_HTTP = {400: outcomes.BAD_REQUEST, 404: outcomes.NOT_FOUND, 503: outcomes.UNAVAILABLE}


def _status(error: BaseException) -> str:
    """The outcome of a request that `error` ended before the engine finished it."""
    if isinstance(error, APIError):
        if error.code == SLOT_CORRUPTED:
            return outcomes.ERROR  # it was served, from bad weights, and stopped: a failure, not a refusal
        return _STATUS_OF_HTTP.get(error.status, outcomes.ERROR)
    if isinstance(error, ClientDisconnected | asyncio.CancelledError | GeneratorExit):
        return outcomes.ABORTED
    return outcomes.ERROR


def _as_api_error(exc: BaseException) -> BaseException:
    """The HTTP error for what stopped a request from starting."""
    if isinstance(exc, APIError | ClientDisconnected | asyncio.CancelledError):
        return exc
    if isinstance(exc, SlotCorruptedError):
        return slot_corrupted(str(exc))
    if isinstance(exc, AdapterNotFoundError):
        return APIError(404, f"{exc} (it was unloaded meanwhile)", param="model", code="model_not_found")
    if isinstance(exc, AdapterError):
        return APIError(500, f"The adapter could not be loaded on this worker: {exc}", code="adapter_load_failed")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    return exc
