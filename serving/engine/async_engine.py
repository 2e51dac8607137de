"""The asyncio face of the engine, for the HTTP server: many concurrent callers, one engine thread.

A background thread owns the ``LLMEngine`` and runs its steps back to back while there is work.
Callers never touch the engine's state: every call becomes a command that the engine thread runs
between two steps, and outputs travel back to each caller's event loop through its own queue.
Adapter loads run on loader threads, so a load never pauses the steps of other requests.

A step that fails fails its requests and the engine goes on, except when a tensor-parallel rank
died (``RankFailedError``): no step can run again, so from then on the engine is not running,
every request fails at once, and ``on_dead`` tells the owner (the worker goes not-ready).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Collection
from concurrent.futures import Future
from typing import Any, TypeVar

from transformers import PreTrainedTokenizerBase

from serving.engine.config import EngineConfig
from serving.engine.distributed.parallel import RankFailedError
from serving.engine.llm_engine import LLMEngine
from serving.engine.prompts import PromptType
from serving.engine.lora.cache import Placement
from serving.engine.lora.request import LoRARequest
from serving.engine.outputs import RequestOutput
from serving.engine.sampling_params import SamplingParams
from serving.engine.stats import EngineStats, LoRAInfo, SlotRepair

logger = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")

# How long the engine thread sleeps when idle before re-checking; commands and finished adapter
# loads wake it at once, so this only bounds the delay after a missed wake-up.
_IDLE_WAIT_S = 1.0


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or a step failed and took the request with it)."""


class AsyncEngine:
    def __init__(self, config: EngineConfig, *, on_dead: Callable[[Exception], None] = lambda error: None) -> None:
        """``on_dead(error)`` is called once, on the engine thread, if the engine can run no more."""
        self._wake = threading.Event()
        self._on_dead = on_dead
        self._dead: Exception | None = None
        self.engine = LLMEngine(config, on_load_done=self._wake.set)
        self._commands: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | Exception]]] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, model: str, **kwargs: Any) -> AsyncEngine:
        """``AsyncEngine.from_args(PATH, max_loras=..., ...)``: any ``EngineConfig`` field."""
        return cls(EngineConfig(model=model, **kwargs))

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return int(self.engine.hf_config.vocab_size)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self._dead is None

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
        cannot be loaded, SlotCorruptedError when its adapter's GPU slot failed its checksum under it. Leaving the loop early (a client disconnect) aborts the request.
        """
        self._check_alive()
        encoded = self.engine.encode(prompt)
        self.engine.validate(encoded[1], sampling_params)
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (loop, stream)

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt, sampling_params, lora_request, priority, encoded=encoded)
            except Exception as exc:  # delivered to the caller, whose request it is
                self._deliver(request_id, exc)

        finished = False
        self._submit(add)
        try:
            while True:
                item = await stream.get()
                # Outputs are cumulative: when the caller lags, only the newest one matters.
                while not isinstance(item, Exception) and not item.finished and not stream.empty():
                    item = stream.get_nowait()
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
                self._submit(lambda: self.engine.abort_request(request_id))

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with ``finish_reason="abort"``. Unknown ids are ignored."""

        def abort() -> None:
            output = self.engine.abort_request(request_id)
            if output is not None:
                self._deliver(request_id, output)

        await self._call(abort)

    # ---- adapters -------------------------------------------------------------------------

    async def add_lora(self, lora_request: LoRARequest, load_inplace: bool = False, *,
                       background: bool = False) -> LoRAInfo:
        """Load an adapter into the CPU cache under its name (off the decode path) and describe it.

        Raises AdapterError with the reason (bad files, rank, modules, digest, base model), or when
        the name is loaded with other content and ``load_inplace`` is False. With ``load_inplace``
        the name is re-pointed at once: requests already running keep the old weights, every later
        request gets the new ones. ``background`` (a prefetch's load) reads on the prefetch thread,
        so requests waiting for reads never queue behind it."""

        def describe(_: object) -> LoRAInfo:
            (info,) = self.engine.list_loras([lora_request.lora_name])
            return info

        return await self._await_load(
            lambda: self.engine.add_lora(lora_request, load_inplace=load_inplace, background=background), describe)

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
        return await self._await_load(lambda: self.engine.prefetch_lora(lora_request, to_gpu=to_gpu, keep=keep),
                                      lambda p: p)

    async def verify_slots(self) -> list[SlotRepair]:
        """Check every occupied GPU slot's checksum (between two steps); each slot that changed since
        it was written is repaired from storage in the background and listed here. The requests
        that had produced tokens from such a slot end at once with SlotCorruptedError; those that
        had produced nothing wait for the repair (LLMEngine.verify_slots)."""
        return await self._call(self.engine.verify_slots)

    async def remove_lora(self, name: str) -> None:
        """Unload ``name`` (AdapterNotFoundError if it is not loaded). Requests already using it
        finish with it; its GPU slot and CPU copy are freed when the last one does."""
        await self._call(lambda: self.engine.remove_lora(name))

    async def list_loras(self, names: Collection[str] | None = None) -> list[LoRAInfo]:
        """The loaded adapters, or only those of ``names`` loaded (LLMEngine.list_loras)."""
        return await self._call(lambda: self.engine.list_loras(names))

    async def get_stats(self) -> EngineStats:
        """Queue depth, running sequences, KV use, slot and cache residency, load counters."""
        return await self._call(self.engine.stats)

    # ---- life cycle -----------------------------------------------------------------------

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every request (their streams end with ``"abort"``) and stop the engine thread."""
        if not self._thread.is_alive():
            return

        def stop() -> None:
            for request_id in self.engine.request_ids():
                output = self.engine.abort_request(request_id)
                if output is not None:
                    self._deliver(request_id, output)
            self._stopping = True

        self._submit(stop)
        self._thread.join(timeout)
        self.engine.shutdown()

    # ---- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            while True:
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
                if self._stopping:
                    return
            if self._dead is not None:
                self._fail_all(self._dead)  # a request that came in since: nothing can run it
                self._wake.wait(_IDLE_WAIT_S)
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:
                logger.exception("engine step failed; failing its requests")
                self._fail_all(exc)
                if isinstance(exc, RankFailedError):
                    self._dead = exc
                    self._on_dead(exc)
                continue
            if outputs:
                self._deliver_step(outputs)
            if self.engine.last_step_tokens == 0:
                self._wake.wait(_IDLE_WAIT_S)

    def _fail_all(self, exc: Exception) -> None:
        error = EngineDeadError(f"the engine step failed: {exc!r}")
        for request_id in self.engine.request_ids():
            try:
                self.engine.abort_request(request_id)
            finally:
                self._deliver(request_id, error)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, in one hop per caller loop: at a few hundred running requests, a
        ``call_soon_threadsafe`` per output (a lock, a self-pipe write and a loop wake-up each)
        is most of the engine thread's delivery cost and floods the HTTP loop's ready queue."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[RequestOutput | Exception], RequestOutput]]] = {}
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
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:
            pass  # the caller's event loop is closed: nobody is listening any more

    def _submit(self, command: Callable[[], object]) -> None:
        self._commands.put(command)
        self._wake.set()

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread between steps and return its result here."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        result: asyncio.Future[T] = loop.create_future()

        def command() -> None:
            try:
                value = fn()
            except Exception as exc:
                loop.call_soon_threadsafe(_settle_error, result, exc)
            else:
                loop.call_soon_threadsafe(_settle_result, result, value)

        self._submit(command)
        return await result

    async def _await_load(self, start: Callable[[], Future[T]], then: Callable[[T], R]) -> R:
        """Run ``start`` on the engine thread and await the adapter load it returns; ``then`` turns
        the load's result into the answer, on the engine thread too (the load completes inside a
        step's poll, so the engine's state may be read there)."""
        loop = asyncio.get_running_loop()
        result: asyncio.Future[R] = loop.create_future()

        def fail(error: BaseException) -> None:
            loop.call_soon_threadsafe(_settle_error, result, error)

        def done(load: Future[T]) -> None:
            error = load.exception()
            if error is not None:
                fail(error)
                return
            try:
                value = then(load.result())
            except Exception as exc:
                fail(exc)
            else:
                loop.call_soon_threadsafe(_settle_result, result, value)

        def command() -> None:
            try:
                start().add_done_callback(done)
            except Exception as exc:
                fail(exc)

        self._submit(command)
        return await result

    def _check_alive(self) -> None:
        if not self.is_running:
            raise EngineDeadError(f"the engine has stopped: {self._dead}" if self._dead else "the engine is shut down")



def _put_all(batch: list[tuple[asyncio.Queue[RequestOutput | Exception], RequestOutput]]) -> None:
    for stream, output in batch:
        stream.put_nowait(output)


def _settle_result(future: asyncio.Future[T], value: T) -> None:
    """Complete ``future`` with ``value`` unless its awaiter has gone (cancelled)."""
    if not future.done():
        future.set_result(value)


def _settle_error(future: asyncio.Future[T], error: BaseException) -> None:
    """Fail ``future`` with ``error`` unless its awaiter has gone (cancelled)."""
    if not future.done():
        future.set_exception(error)
