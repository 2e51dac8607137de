"""The asyncio face of the engine, for the HTTP server: many concurrent callers, one engine thread.

A background thread owns the ``LLMEngine`` and runs its steps back to back while there is work
(serving.engine.engine_core, the loop the engine-core process runs too).
Callers never touch the engine's state: every call becomes a command that the engine thread runs
between two steps, and outputs travel back to each caller's event loop through its own queue
(serving.engine.engine_client, shared with ``ProcessEngine``).
Adapter loads run on loader threads, so a load never pauses the steps of other requests.

A step that fails fails its requests and the engine goes on, except when a tensor-parallel rank
died (``RankFailedError``): no step can run again, so from then on the engine is not running,
every request fails at once, and ``on_dead`` tells the owner (the worker goes not-ready).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Collection
from concurrent.futures import Future
from typing import Any, TypeVar

from transformers import PreTrainedTokenizerBase

from serving.engine.config import EngineConfig
from serving.engine.engine_client import EngineClient, EngineDeadError, settle_error, settle_result
from serving.engine.engine_core import EngineCore
from serving.engine.lora.cache import Placement
from serving.engine.lora.request import LoRARequest
from serving.engine.prompts import PromptType
from serving.engine.sampling_params import SamplingParams
from serving.engine.stats import EngineStats, LoRAInfo, SlotRepair

__all__ = ["AsyncEngine", "EngineDeadError"]

T = TypeVar("T")
R = TypeVar("R")


class AsyncEngine(EngineClient):
    def __init__(self, config: EngineConfig, *, on_dead: Callable[[Exception], None] = lambda error: None) -> None:
        """``on_dead(error)`` is called once, on the engine thread, if the engine can run no more."""
        super().__init__()
        self._core = EngineCore(config, emit_step=self._deliver_step, emit=self._deliver, on_dead=on_dead)
        self.engine = self._core.engine
        self._thread = threading.Thread(target=self._core.run, name="engine-core", daemon=True)
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
        return self._thread.is_alive() and not self._core.stopping and self._core.dead is None

    # ---- requests -------------------------------------------------------------------------

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.engine.encode(prompt)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(token_ids, params)

    def _add(self, request_id: str, prompt: PromptType, params: SamplingParams, lora_request: LoRARequest | None,
             priority: int, encoded: tuple[str | None, list[int]]) -> None:
        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt, params, lora_request, priority, encoded=encoded)
            except Exception as exc:  # delivered to the caller, whose request it is
                self._deliver(request_id, exc)

        self._core.submit(add)

    def _drop(self, request_id: str) -> None:
        self._core.submit(lambda: self.engine.abort_request(request_id))

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
        self._core.submit(self._core.stop)
        self._thread.join(timeout)
        self.engine.shutdown()

    # ---- calls onto the engine thread -----------------------------------------------------

    def _submit(self, command: Callable[[], object]) -> None:
        self._core.submit(command)

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread between steps and return its result here."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        result: asyncio.Future[T] = loop.create_future()

        def command() -> None:
            try:
                value = fn()
            except Exception as exc:
                loop.call_soon_threadsafe(settle_error, result, exc)
            else:
                loop.call_soon_threadsafe(settle_result, result, value)

        self._submit(command)
        return await result

    async def _await_load(self, start: Callable[[], Future[T]], then: Callable[[T], R]) -> R:
        """Run ``start`` on the engine thread and await the adapter load it returns; ``then`` turns
        the load's result into the answer, on the engine thread too (the load completes inside a
        step's poll, so the engine's state may be read there)."""
        loop = asyncio.get_running_loop()
        result: asyncio.Future[R] = loop.create_future()

        def fail(error: BaseException) -> None:
            loop.call_soon_threadsafe(settle_error, result, error)

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
                loop.call_soon_threadsafe(settle_result, result, value)

        def command() -> None:
            try:
                start().add_done_callback(done)
            except Exception as exc:
                fail(exc)

        self._submit(command)
        return await result

    def _check_alive(self) -> None:
        if not self.is_running:
            dead = self._core.dead
            raise EngineDeadError(f"the engine has stopped: {dead}" if dead else "the engine is shut down")
