"""Running one HTTP generation request on the engine, shared by completions and chat: the model
name resolved to an adapter, sampling parameters checked against the context, admission, the
engine's cumulative outputs turned into deltas, latency metrics, and abort when the client leaves.

The first delta is awaited before any response is sent, so errors the engine raises at the start
(a bad prompt, an adapter that cannot be loaded) become proper HTTP errors, also for streams.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import Request

from serving.engine import AdapterError, AdapterNotFoundError, EngineDeadError, LoRARequest, SamplingParams
from serving.engine.outputs import Logprob
from serving.engine.server import metrics as outcomes
from serving.engine.server.errors import APIError, bad_request, model_not_found
from serving.engine.server.protocol import UsageInfo, SamplingFields
from serving.engine.server.worker import Worker

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


class Outcome:
    """The one record of how a request ended (loraplex_requests_total); the first call wins."""

    def __init__(self, worker: Worker, model: str) -> None:
        self._metrics = worker.metrics
        self.model = model
        self._done = False

    def finish(self, status: str) -> None:
        if not self._done:
            self._done = True
            self._metrics.requests.labels(self.model, status).inc()

    def fail(self, error: BaseException) -> None:
        if isinstance(error, APIError):
            status = {400: outcomes.BAD_REQUEST, 404: outcomes.NOT_FOUND, 503: outcomes.UNAVAILABLE}.get(
                error.status, outcomes.ERROR
            )
        elif isinstance(error, (ClientDisconnected, asyncio.CancelledError)):
            status = outcomes.ABORTED
        else:
            status = outcomes.ERROR
        self.finish(status)


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


def resolve_model(worker: Worker, model: str) -> LoRARequest | None:
    """None for the base model, the adapter's request for a loaded adapter name, else 404."""
    _, adapters = worker.require_ready()
    if model in worker.base_model_ids:
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


def sampling_params(body: SamplingFields, *, prompt_len: int, max_model_len: int, logprobs: int | None) -> SamplingParams:
    """The engine's SamplingParams for `body`; every invalid value is a 400 that names it."""
    max_tokens = _max_tokens(body.max_tokens, prompt_len, max_model_len)
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
        )
    if requested is None:
        return max_model_len - prompt_len
    if prompt_len + requested > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the completion). "
            "Please reduce the length of the prompt or of max_tokens.",
            param="max_tokens",
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


async def start_generation(body: SamplingFields, request: Request, worker: Worker, outcome: Outcome, *, kind: str,
                           prompt_token_ids: Callable[[], Awaitable[list[int]]],
                           logprobs: int | None) -> tuple[Generation, Delta]:
    """Check a request for `body.model`, build its prompt and sampling parameters, admit it and wait
    for its first delta. The prompt is built only once the model and fields are known good, so those
    errors come first."""
    lora_request = resolve_model(worker, body.model)
    check_supported(body)
    engine, _ = worker.require_ready()
    ids = await prompt_token_ids()
    params = sampling_params(body, prompt_len=len(ids), max_model_len=engine.max_model_len, logprobs=logprobs)
    return await Generation.start(
        worker, outcome, request, kind=kind, prompt_token_ids=ids, params=params,
        lora_request=lora_request, priority=body.priority,
    )


class Generation:
    """One admitted request on the engine, yielding deltas.

    However it ends — the last token, an error, the client leaving (the stream is cancelled), the
    worker draining — `close()` aborts the engine request if it is unfinished, so its KV blocks and
    adapter slot are freed at once, releases its admission and records the outcome.
    """

    def __init__(self, worker: Worker, outcome: Outcome, *, kind: str, prompt_token_ids: list[int],
                 params: SamplingParams, lora_request: LoRARequest | None, priority: int) -> None:
        self._worker = worker
        self._engine, _ = worker.require_ready()
        self._outcome = outcome
        self.request_id = f"{kind}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.usage = Usage(prompt_tokens=len(prompt_token_ids))
        self.prompt_token_ids = prompt_token_ids
        self._params = params
        self._lora_request = lora_request
        self._priority = priority
        self._arrival = time.perf_counter()
        self._last_token_at: float | None = None
        self._text_sent = 0
        self._tokens_sent = 0
        self.finished = False
        self._closed = False
        self._stream: AsyncIterator[Delta] | None = None

    def decode(self, token_ids: list[int]) -> str:
        """Text of tokens (for logprobs), usable to the end of the stream, draining included."""
        return self._engine.tokenizer.decode(token_ids)

    @classmethod
    async def start(cls, worker: Worker, outcome: Outcome, request: Request, **kwargs: object) -> tuple[Generation, Delta]:
        """Admit the request and wait for its first delta (or the error that prevents one)."""
        generation = cls(worker, outcome, **kwargs)  # type: ignore[arg-type]
        worker.admit(generation.request_id)
        try:
            first = await unless_disconnected(request, generation.next())
        except BaseException as exc:
            error = _as_api_error(exc)
            outcome.fail(error)
            generation.close()
            if error is exc:
                raise
            raise error from exc
        if first is None:
            generation.close()
            raise APIError(500, "The engine ended the request without output.")
        return generation, first

    async def next(self) -> Delta | None:
        """The next delta, or None after the last one."""
        if self._stream is None:
            self._stream = self._run()
        if self.finished:
            return None
        try:
            return await anext(self._stream)
        except StopAsyncIteration:
            return None

    async def _run(self) -> AsyncIterator[Delta]:
        metrics = self._worker.metrics
        async for output in self._engine.generate(
            {"prompt_token_ids": self.prompt_token_ids},
            self._params,
            self.request_id,
            lora_request=self._lora_request,
            priority=self._priority,
        ):
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
                self._outcome.finish(outcomes.ABORTED if completion.finish_reason == "abort" else outcomes.OK)
            yield delta

    async def collect(self, first: Delta, request: Request) -> list[Delta]:
        """The whole output, `first` included, for a reply that is not streamed; closes the
        generation however it ends."""
        try:
            return [first, *await self.rest(request)]
        finally:
            self.close()

    async def rest(self, request: Request) -> list[Delta]:
        """Every remaining delta, aborting if the client leaves meanwhile."""

        async def collect() -> list[Delta]:
            return [delta async for delta in self._deltas()]

        return await unless_disconnected(request, collect())

    async def _deltas(self) -> AsyncIterator[Delta]:
        while (delta := await self.next()) is not None:
            yield delta

    def close(self) -> None:
        """Abort if unfinished, release admission, record the outcome; idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            self._worker.abort_soon(self.request_id)
            self._outcome.finish(outcomes.ABORTED)
        metrics = self._worker.metrics
        metrics.prompt_tokens.labels(self._outcome.model).inc(self.usage.prompt_tokens)
        metrics.generation_tokens.labels(self._outcome.model).inc(self.usage.completion_tokens)
        self._worker.release(self.request_id)


def _as_api_error(exc: BaseException) -> BaseException:
    """The HTTP error for what stopped a request from starting."""
    if isinstance(exc, APIError | ClientDisconnected | asyncio.CancelledError):
        return exc
    if isinstance(exc, AdapterNotFoundError):
        return APIError(404, f"{exc} (it was unloaded meanwhile)", param="model", code="model_not_found")
    if isinstance(exc, AdapterError):
        return APIError(500, f"The adapter could not be loaded on this worker: {exc}", code="adapter_load_failed")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    return exc
