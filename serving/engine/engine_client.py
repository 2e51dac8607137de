"""The asyncio face of an engine, whatever drives it: the calls, and the per-request streams.

Two engines wear this face: ``AsyncEngine`` (the ``LLMEngine`` on a thread of this process) and
``ProcessEngine`` (the ``LLMEngine`` in a child process, serving.engine.process_engine). What they
share lives here, so the two cannot drift apart: each request's stream (a ``Stream`` on its
caller's event loop), the delivery of a step's outputs to those streams in one hop per event loop
(each request's first output before the rest),
``generate()``, which checks the prompt here, hands the request to the engine, yields its
cumulative outputs and aborts it when the caller leaves early, and every call, each one command
(serving.engine.engine_messages) that ``EngineCore`` runs. How a command reaches the engine is each
engine's own, and all it does: ``_submit`` (no answer) and ``_call`` (await the answer).
"""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Collection
from typing import Any, TypeVar, cast

from transformers import PreTrainedTokenizerBase

from serving.engine.config import EngineConfig
from serving.engine.engine_messages import (
    AbortRequest,
    AddLora,
    AddRequest,
    DropRequest,
    EngineCommand,
    GetStats,
    ListLoras,
    PrefetchLora,
    RemoveLora,
    VerifySlots,
    WarmUp,
)
from serving.engine.lora.cache import Placement
from serving.engine.lora.request import LoRARequest
from serving.engine.outputs import RequestOutput
from serving.engine.prompts import PromptType
from serving.engine.sampling_params import SamplingParams
from serving.engine.stats import EngineStats, LoRAInfo, SlotRepair
from serving.engine.warmup import WarmupReport

T = TypeVar("T")


class Stream:
    """One request's outputs and failure, put on its caller's event loop and read there by its
    ``generate()``. A queue with one reader and nothing more: it is touched for every token of
    every stream, and without ``asyncio.Queue``'s bookkeeping (putters, unfinished tasks, empty
    checks) a put and its read cost the loop 2.6 µs instead of 3.4 (uvloop, the 2-core dev VM)."""

    __slots__ = ("_items", "_loop", "_waiter", "fresh")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[RequestOutput | Exception] = deque()
        self._waiter: asyncio.Future[None] | None = None
        # Nothing put yet: its first item is the request's first token (or its failure).
        self.fresh = True

    def put(self, item: RequestOutput | Exception) -> None:
        """Add ``item`` and wake the reader; on the stream's loop only."""
        self.fresh = False
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> RequestOutput | Exception:
        """The next item, waiting for one. Outputs are cumulative: of those that wait, only the
        newest matters, so they are skipped up to the newest, a last output or a failure."""
        items = self._items
        while not items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = items.popleft()
        while items and not isinstance(item, Exception) and not item.finished:
            item = items.popleft()
        return item



class EngineDeadError(RuntimeError):
    """The engine stopped (shut down, its process died, or a step failed and took the request with it)."""


class EngineClient(ABC):
    """What the HTTP server calls. Subclasses carry commands to an ``EngineCore`` (``_submit``,
    ``_call``) and report each step's outputs with ``_deliver_step`` and a single request's output
    or failure with ``_deliver``, from any thread."""

    def __init__(self) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, Stream]] = {}
        self._lock = threading.Lock()

    # ---- what each engine says about itself ------------------------------------------------

    @property
    @abstractmethod
    def config(self) -> EngineConfig: ...

    @property
    @abstractmethod
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    @property
    @abstractmethod
    def model_name(self) -> str: ...

    @property
    @abstractmethod
    def max_model_len(self) -> int: ...

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def is_running(self) -> bool: ...

    # ---- requests -------------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's cumulative outputs; the last one has ``finished=True``.

        Raises ValueError for a bad prompt or a request id in use, AdapterError when its adapter
        cannot be loaded, SlotCorruptedError when its adapter's GPU slot failed its checksum under it,
        EngineDeadError when the engine stopped. Leaving the loop early (a client disconnect) aborts
        the request."""
        self._check_alive()
        # Checked here, on the caller's thread: a bad prompt fails before it reaches the engine.
        encoded = self._encode(prompt)
        self._validate(encoded[1], sampling_params)
        loop = asyncio.get_running_loop()
        stream = Stream(loop)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (loop, stream)

        # The engine reads only the salt of a prompt it is given encoded: the token ids cross once.
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        command = AddRequest(request_id, sampling_params, encoded, lora_request, priority, cache_salt=salt)
        finished = False
        try:
            self._submit(command)
            while True:
                item = await stream.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                if item.error is not None:
                    finished = True
                    raise item.error
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                try:
                    self._submit(DropRequest(request_id))
                except EngineDeadError:
                    pass  # nothing runs it any more

    @abstractmethod
    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """``(prompt text or None, token ids)`` (``LLMEngine.encode``)."""

    @abstractmethod
    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a prompt the engine cannot serve (``LLMEngine.validate``)."""

    @abstractmethod
    def _check_alive(self) -> None:
        """Raise EngineDeadError when the engine can take no more work."""

    @abstractmethod
    def _submit(self, command: EngineCommand) -> None:
        """Hand ``command`` to the engine without waiting (EngineDeadError when nothing can run it)."""

    @abstractmethod
    async def _call(self, command: EngineCommand) -> Any:
        """Hand ``command`` to the engine and return its answer, or raise the error it raised."""

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with ``finish_reason="abort"``. Unknown ids are ignored."""
        await self._call(AbortRequest(request_id))

    # ---- adapters and state ---------------------------------------------------------------

    async def add_lora(self, lora_request: LoRARequest, load_inplace: bool = False, *,
                       background: bool = False) -> LoRAInfo:
        """Load an adapter into the CPU cache under its name (off the decode path) and describe it.

        Raises AdapterError with the reason (bad files, rank, modules, digest, base model), or when
        the name is loaded with other content and ``load_inplace`` is False. With ``load_inplace``
        the name is re-pointed at once: requests already running keep the old weights, every later
        request gets the new ones. ``background`` (a prefetch's load) reads on the prefetch thread,
        so requests waiting for reads never queue behind it."""
        return cast(LoRAInfo, await self._call(AddLora(lora_request, load_inplace, background)))

    async def prefetch_lora(self, lora_request: LoRARequest, *, to_gpu: bool, keep: Collection[str] = ()) -> Placement:
        """Bring an adapter up ahead of its traffic (predictive prewarm) and say where it ended.

        The adapter is read into the CPU cache under ``lora_request.lora_name`` on a loader thread,
        as ``add_lora`` does (no read when that name already holds that content in memory); the
        decode steps of other requests go on meanwhile. With ``to_gpu`` it is then copied into a
        GPU slot, unpinned, only where a slot is empty or holds an idle adapter (no running
        sequence and no waiting request; the least recently used such slot) and holds none of the
        names in ``keep`` (the others a prewarm round wants in a slot, so one placement does not
        evict another): a pinned, busy or kept slot is never evicted. Returns ``"gpu"`` when it is
        in a slot, ``"cpu"`` when it is in the CPU cache only (``to_gpu=False``, or every slot
        pinned, busy or kept).

        Raises AdapterError as ``add_lora`` does (bad files, digest, base model, LoRA disabled),
        and when the name is loaded from another path: a prefetch never changes what a name
        serves. Measure its effect with ``get_stats()``: ``slot_hits`` / ``slot_misses`` (GPU-slot
        hit rate of admissions) and ``adapter_load_stalls`` (requests that waited for a read)."""
        return cast(Placement, await self._call(PrefetchLora(lora_request, to_gpu, tuple(keep))))

    async def verify_slots(self) -> list[SlotRepair]:
        """Check every occupied GPU slot's checksum (between two steps); each slot that changed since
        it was written is repaired from storage in the background and listed here. The requests
        that had produced tokens from such a slot end at once with SlotCorruptedError; those that
        had produced nothing wait for the repair (LLMEngine.verify_slots)."""
        return cast(list[SlotRepair], await self._call(VerifySlots()))

    async def remove_lora(self, name: str) -> None:
        """Unload ``name`` (AdapterNotFoundError if it is not loaded). Requests already using it
        finish with it; its GPU slot and CPU copy are freed when the last one does."""
        await self._call(RemoveLora(name))

    async def list_loras(self, names: Collection[str] | None = None) -> list[LoRAInfo]:
        """The loaded adapters, or only those of ``names`` loaded (LLMEngine.list_loras)."""
        return cast(list[LoRAInfo], await self._call(ListLoras(None if names is None else tuple(names))))

    async def get_stats(self) -> EngineStats:
        """Queue depth, running sequences, KV use, slot and cache residency, load counters."""
        return cast(EngineStats, await self._call(GetStats()))

    async def warm_up(self, adapters: Collection[str] = ()) -> WarmupReport:
        """Run every kind of step the scheduler can produce once, with ``adapters`` (loaded names)
        in them, before any traffic (serving.engine.warmup); RuntimeError if a warm-up request
        fails or requests are already queued."""
        return cast(WarmupReport, await self._call(WarmUp(tuple(adapters))))

    @abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every request (their streams end with ``"abort"``) and stop the engine."""

    # ---- delivery, from the thread that drives or hears the engine --------------------------

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, in one hop per caller loop: at a few hundred running requests, a
        ``call_soon_threadsafe`` per output (a lock, a self-pipe write and a loop wake-up each)
        is most of the delivery cost and floods the HTTP loop's ready queue."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[Stream, RequestOutput]]] = {}
        with self._lock:
            streams = self._streams
            for output in outputs:
                target = streams.get(output.request_id)
                if target is not None:
                    batches.setdefault(target[0], []).append((target[1], output))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:
                pass  # the caller's event loop is closed: nobody is listening any more

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is None:
            return
        loop, stream = target
        try:
            loop.call_soon_threadsafe(stream.put, item)
        except RuntimeError:
            pass  # the caller's event loop is closed: nobody is listening any more

    def _fail_streams(self, error: Exception) -> None:
        """End every open stream with ``error`` (the engine is gone: nothing else will end them)."""
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._deliver(request_id, error)


def _put_all(batch: list[tuple[Stream, RequestOutput]]) -> None:
    """Put a step's outputs, each request's first output before the others. The loop resumes the
    readers in the order they are woken, and each then formats and sends its chunk (~30 µs): at a
    few hundred streams that is milliseconds a step, and a first token behind the rest would add
    them to its request's time to first token (the worker's first-token delivery phase)."""
    later: list[tuple[Stream, RequestOutput]] = []
    for stream, output in batch:
        if stream.fresh:
            stream.put(output)
        else:
            later.append((stream, output))
    for stream, output in later:
        stream.put(output)


def settle_from_thread(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], ok: bool, value: object) -> None:
    """Settle ``future`` with a command's answer (``EngineCore``'s ``reply(ok, value)``), from any
    thread, on its event loop."""
    try:
        if ok:
            loop.call_soon_threadsafe(settle_result, future, value)
        else:
            loop.call_soon_threadsafe(settle_error, future, cast(BaseException, value))
    except RuntimeError:
        pass  # the caller's event loop is closed: nobody is waiting any more


def settle_result(future: asyncio.Future[T], value: T) -> None:
    """Complete ``future`` with ``value`` unless its awaiter has gone (cancelled)."""
    if not future.done():
        future.set_result(value)


def settle_error(future: asyncio.Future[T], error: BaseException) -> None:
    """Fail ``future`` with ``error`` unless its awaiter has gone (cancelled)."""
    if not future.done():
        future.set_exception(error)
