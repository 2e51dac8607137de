"""The asyncio face of an engine, whatever drives it: the calls, and the per-request streams.

Two engines wear this face: ``AsyncEngine`` (the ``LLMEngine`` on a thread of this process) and
``ProcessEngine`` (the ``LLMEngine`` in a child process, serving.engine.process_engine). What they
share lives here, so the two cannot drift apart: each request's stream (an ``asyncio.Queue`` on its
caller's event loop), the delivery of a step's outputs to those streams in one hop per event loop,
and ``generate()``, which checks the prompt here, hands the request to the engine, yields its
cumulative outputs and aborts it when the caller leaves early. How a request, an abort or a call
reaches the engine is each engine's own (the ``_add`` / ``_drop`` hooks and the calls).
"""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Collection
from typing import TypeVar

from transformers import PreTrainedTokenizerBase

from serving.engine.config import EngineConfig
from serving.engine.lora.cache import Placement
from serving.engine.lora.request import LoRARequest
from serving.engine.outputs import RequestOutput
from serving.engine.prompts import PromptType
from serving.engine.sampling_params import SamplingParams
from serving.engine.stats import EngineStats, LoRAInfo, SlotRepair

T = TypeVar("T")
Stream = asyncio.Queue[RequestOutput | Exception]


class EngineDeadError(RuntimeError):
    """The engine stopped (shut down, its process died, or a step failed and took the request with it)."""


class EngineClient(ABC):
    """What the HTTP server calls. Subclasses drive an ``LLMEngine`` and report each step's outputs
    with ``_deliver_step`` and a single request's output or failure with ``_deliver``, from any
    thread."""

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
        stream: Stream = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (loop, stream)

        finished = False
        try:
            self._add(request_id, prompt, sampling_params, lora_request, priority, encoded)
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
                self._drop(request_id)

    @abstractmethod
    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """``(prompt text or None, token ids)`` (``LLMEngine.encode``)."""

    @abstractmethod
    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a prompt the engine cannot serve (``LLMEngine.validate``)."""

    @abstractmethod
    def _add(self, request_id: str, prompt: PromptType, params: SamplingParams, lora_request: LoRARequest | None,
             priority: int, encoded: tuple[str | None, list[int]]) -> None:
        """Hand the request to the engine; its failure to start is ``_deliver``-ed to its stream."""

    @abstractmethod
    def _drop(self, request_id: str) -> None:
        """Abort a request whose caller left, without waiting: nobody reads its stream any more."""

    @abstractmethod
    def _check_alive(self) -> None:
        """Raise EngineDeadError when the engine can take no more work."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with ``finish_reason="abort"``. Unknown ids are ignored."""

    # ---- adapters and state ---------------------------------------------------------------

    @abstractmethod
    async def add_lora(self, lora_request: LoRARequest, load_inplace: bool = False, *,
                       background: bool = False) -> LoRAInfo:
        """Load an adapter into the CPU cache under its name and describe it (AsyncEngine.add_lora)."""

    @abstractmethod
    async def prefetch_lora(self, lora_request: LoRARequest, *, to_gpu: bool, keep: Collection[str] = ()) -> Placement:
        """Bring an adapter up ahead of its traffic; where it ended (AsyncEngine.prefetch_lora)."""

    @abstractmethod
    async def verify_slots(self) -> list[SlotRepair]:
        """Check every occupied GPU slot's checksum; the repairs started (AsyncEngine.verify_slots)."""

    @abstractmethod
    async def remove_lora(self, name: str) -> None:
        """Unload ``name`` (AdapterNotFoundError if it is not loaded)."""

    @abstractmethod
    async def list_loras(self, names: Collection[str] | None = None) -> list[LoRAInfo]:
        """The loaded adapters, or only those of ``names`` loaded."""

    @abstractmethod
    async def get_stats(self) -> EngineStats:
        """Queue depth, running sequences, KV use, slot and cache residency, load counters."""

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
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:
            pass  # the caller's event loop is closed: nobody is listening any more

    def _fail_streams(self, error: Exception) -> None:
        """End every open stream with ``error`` (the engine is gone: nothing else will end them)."""
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._deliver(request_id, error)


def _put_all(batch: list[tuple[Stream, RequestOutput]]) -> None:
    for stream, output in batch:
        stream.put_nowait(output)


def settle_result(future: asyncio.Future[T], value: T) -> None:
    """Complete ``future`` with ``value`` unless its awaiter has gone (cancelled)."""
    if not future.done():
        future.set_result(value)


def settle_error(future: asyncio.Future[T], error: BaseException) -> None:
    """Fail ``future`` with ``error`` unless its awaiter has gone (cancelled)."""
    if not future.done():
        future.set_exception(error)
