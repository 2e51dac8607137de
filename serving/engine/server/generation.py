"""Running one HTTP generation request on the engine, shared by completions and chat.

completions.py and chat.py build a `GenerationRequest` once from the parsed body; `Generation`
runs it: the model name resolved to an adapter, the fields checked, the prompts built, sampling
parameters checked against the context (server.sampling), admission, the engine's cumulative
outputs turned into deltas, latency metrics, and abort when the client leaves.

A request of several prompts (completions' list) is one engine request per prompt, run together
and admitted each; with `n` completions a prompt, each delta carries its choice's index,
`prompt_i * n + j` as OpenAI numbers them, and the deltas of different choices interleave.

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
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from starlette.requests import Request

from serving.engine import (
    AdapterError,
    AdapterNotFoundError,
    EngineClient,
    EngineDeadError,
    Logprob,
    LoRARequest,
    RequestOutput,
    SlotCorruptedError,
)
from serving.engine.detokenizer import decode_text
from serving.engine.guided import GrammarError
from serving.engine.server import metrics as outcomes
from serving.engine.server.adapters import AdapterSet
from serving.engine.server.errors import APIError, bad_request, model_not_found, slot_corrupted
from serving.engine.server.on_demand import ensure_loaded
from serving.contracts.protocol import PromptTokensDetails, SamplingFields, UsageInfo
from serving.engine.server.sampling import check_supported, sampling_params
from serving.engine.server.worker import Worker
from runtime.access_log import access_note
from serving.contracts.registry import SLOT_CORRUPTED

T = TypeVar("T")

# The prompt's token ids, from the ready engine (its tokenizer): one prompt's, or a list of several
# prompts' (completions' list of prompts).
PromptBuilder = Callable[[EngineClient], Awaitable[list[int] | list[list[int]]]]


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
    best_of: int | None = None  # completions': generate this many a prompt, return the n most likely
    prompt_logprobs: int | None = None  # completions' echo with logprobs: the prompts' own, with this many top

    @property
    def model(self) -> str:
        return self.body.model


@dataclass
class Delta:
    """What one engine output adds to one choice of the response (``index``: prompt_i * n + j)."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    index: int = 0


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    # Per prompt, the tokens the prefix cache held at its admission (none while caching is off).
    cached: dict[int, int] = field(default_factory=dict)

    def info(self) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached.values())) if self.cached else None,
        )


def resolve_model(adapters: AdapterSet, base_model_ids: list[str], model: str) -> LoRARequest | None:
    """None for the base model, the adapter's request for a loaded adapter name, else 404."""
    if model in base_model_ids:
        return None
    if adapters.get(model) is None:
        raise model_not_found(model)
    return LoRARequest(model)


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
        self.n = job.body.n or 1
        # Set once the prompts are built (before the first delta).
        self.prompts_token_ids: list[list[int]] = []
        # Per prompt, its tokens' logprobs (job.prompt_logprobs), from its first output.
        self.prompt_logprobs: dict[int, list[dict[int, Logprob] | None]] = {}
        self.usage = Usage(prompt_tokens=0)
        self.finished = False
        self._engine: EngineClient | None = None
        self._arrival = time.perf_counter()
        self._arrival_ns = time.time_ns()  # after the TTFT's start: ServerMetrics.observe_first_token
        self._last_token_at: float | None = None
        self._engine_ids: list[str] = []
        self._running: set[str] = set()  # engine requests not finished
        self._aborted = False
        self._sent: dict[int, tuple[int, int]] = {}  # per choice index: characters and tokens sent
        self._generated: dict[int, int] = {}  # per prompt: tokens generated over all its sequences
        self._ended: set[int] = set()  # choices whose finish was sent
        self._events = self._lifetime()

    @property
    def prompt_token_ids(self) -> list[int]:
        """The first prompt's token ids (chat's only prompt)."""
        return self.prompts_token_ids[0] if self.prompts_token_ids else []

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
        admitted: list[str] = []
        try:
            engine, adapters = worker.require_ready()
            self._engine = engine
            await ensure_loaded(worker, adapters, job.body)
            lora_request = resolve_model(adapters, worker.base_model_ids, job.model)
            check_supported(job.body)
            self.prompts_token_ids = _as_prompts(await job.prompt(engine))
            self.usage = Usage(prompt_tokens=sum(len(ids) for ids in self.prompts_token_ids))
            params = [sampling_params(job.body, prompt_len=len(ids), max_model_len=engine.max_model_len,
                                      vocab_size=engine.vocab_size, max_num_seqs=engine.config.max_num_seqs,
                                      logprobs=job.logprobs, best_of=job.best_of,
                                      prompt_logprobs=job.prompt_logprobs)
                      for ids in self.prompts_token_ids]
            several = len(self.prompts_token_ids) > 1
            self._engine_ids = [f"{self.request_id}-{i}" if several else self.request_id for i in range(len(params))]
            for engine_id in self._engine_ids:
                worker.admit(engine_id, job.body.cache_salt)
                admitted.append(engine_id)
            self._running = set(self._engine_ids)
            outputs = _merged([
                engine.generate(_engine_prompt(ids, job.body.cache_salt), p, engine_id, lora_request=lora_request,
                                priority=job.body.priority)
                for ids, p, engine_id in zip(self.prompts_token_ids, params, self._engine_ids)
            ])
            item: tuple[int, RequestOutput] | None = await self._first_output(outputs)
            while item is not None:
                deltas = self._advance(*item)
                if self.finished:
                    status = outcomes.ABORTED if self._aborted else outcomes.OK
                for delta in deltas:
                    yield delta
                if self.finished:
                    return
                try:
                    item = await _next_output(outputs)
                except GrammarError as exc:  # the caller's grammar reached a dead end mid-output
                    raise self._grammar_refused(exc) from exc
        except BaseException as exc:
            if not self.finished:  # a close after the last delta changes nothing
                status = _status(exc)
            raise
        finally:
            for engine_id in admitted:
                if engine_id in self._running:
                    worker.abort_soon(engine_id)
                worker.release(engine_id)
            if admitted:
                worker.metrics.prompt_tokens.labels(job.model).inc(self.usage.prompt_tokens)
                worker.metrics.generation_tokens.labels(job.model).inc(self.usage.completion_tokens)
            worker.metrics.requests.labels(job.model, status).inc()
            access_note(model=job.model, outcome=status, prompt_tokens=self.usage.prompt_tokens,
                        completion_tokens=self.usage.completion_tokens, completion_id=self.request_id)

    async def _first_output(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> tuple[int, RequestOutput]:
        """The engine's first output, as the HTTP error for what prevents one."""
        try:
            first = await unless_disconnected(self._request, anext(outputs, None))
        except GrammarError as exc:
            raise self._grammar_refused(exc) from exc
        except BaseException as exc:
            error = _as_api_error(exc)
            if error is exc:
                raise
            raise error from exc
        if first is None:
            raise APIError(500, "The engine ended the request without output.")
        return first

    def _grammar_refused(self, error: GrammarError) -> APIError:
        """A constraint the engine refused, as a 400 naming the field it came from."""
        constraints = self.job.body.constraints()
        return bad_request(str(error), param=constraints[0][0] if constraints else None, code=error.code)

    def _advance(self, prompt_index: int, output: RequestOutput) -> list[Delta]:
        """What `output` (of prompt `prompt_index`) adds to each choice; observes the latency
        metrics. A choice's first output always gives a delta, so the first output gives one."""
        metrics = self._worker.metrics
        deltas = []
        if output.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = output.prompt_logprobs
        if output.num_cached_tokens is not None:
            self.usage.cached[prompt_index] = output.num_cached_tokens
        for completion in output.outputs:
            index = prompt_index * self.n + completion.index
            if index in self._ended:
                continue
            text_sent, tokens_sent = self._sent.get(index, (0, 0))
            if (index in self._sent and len(completion.token_ids) == tokens_sent and len(completion.text) == text_sent
                    and completion.finish_reason is None):
                continue
            deltas.append(Delta(
                text=completion.text[text_sent:],
                token_ids=completion.token_ids[tokens_sent:],
                logprobs=completion.logprobs[tokens_sent:] if completion.logprobs is not None else None,
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
                index=index,
            ))
            self._sent[index] = (len(completion.text), len(completion.token_ids))
            if completion.finish_reason is not None:
                self._ended.add(index)
                self._aborted |= completion.finish_reason == "abort"
        # The choices of one request advance together: a step's gap is one inter-token latency each.
        new_tokens = max((len(d.token_ids) for d in deltas), default=0)
        # Read before the TTFT's end, for its first token only: ServerMetrics.observe_first_token.
        sent_ns = time.time_ns() if new_tokens and self._last_token_at is None else 0
        now = time.perf_counter()
        if new_tokens:
            if self._last_token_at is None:
                metrics.observe_first_token(now - self._arrival, self._arrival_ns, sent_ns, output.first_token_times)
            else:
                # Outputs a lagging reader coalesced share the gap evenly.
                gap = (now - self._last_token_at) / new_tokens
                for _ in range(new_tokens):
                    metrics.itl.observe(gap)
            self._last_token_at = now
        # Every token generated is charged: a best_of request's discarded sequences too (the engine's
        # count); the choices' own count where the engine reported none.
        self._generated[prompt_index] = output.num_generated_tokens
        self.usage.completion_tokens = max(sum(tokens for _, tokens in self._sent.values()),
                                           sum(self._generated.values()))
        if output.finished:
            self._running.discard(self._engine_ids[prompt_index])
            if not self._running:
                self.finished = True
                metrics.e2e.observe(now - self._arrival)
        return deltas


def _engine_prompt(token_ids: list[int], cache_salt: str | None) -> dict[str, Any]:
    """The engine's prompt: the token ids, and the prefix cache's salt when the request sent one."""
    prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt


def _as_prompts(built: list[int] | list[list[int]]) -> list[list[int]]:
    """A builder's prompt, or prompts, as a list of prompts."""
    if built and isinstance(built[0], list):
        return built
    return [cast(list[int], built)]


async def _merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of every stream as they come, each with its stream's index. An error in one
    ends them all (the others' pending reads are cancelled, which aborts their engine requests)."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    pending = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                yield i, output
                pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for task in pending:
            task.cancel()


async def _next_output(outputs: AsyncIterator[tuple[int, RequestOutput]]) -> tuple[int, RequestOutput] | None:
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
