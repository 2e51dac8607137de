"""The engine loop and its commands: one thread owns an ``LLMEngine``, runs commands between steps
and steps back to back while there is work, and hands each step's outputs to whoever listens.

Every command a client sends (serving.engine.engine_messages) is run by one method here, through
``handle``: ``AsyncEngine`` submits them on a thread of the serving process and delivers outputs to
its callers' event loops; the engine-core child process (serving.engine.engine_core_child) receives
them from a pipe, submits the same, and sends outputs back. One loop and one command table, so both
engines schedule, answer, fail and stop alike, and the drivers are transports only.

A step that fails fails its requests and the loop goes on, except when a tensor-parallel rank died
(``RankFailedError``): no step can run again, so from then on every request fails at once and
``on_dead`` tells the owner.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, ClassVar, TypeVar

from serving.engine.config import EngineConfig
from serving.engine.distributed.parallel import RankFailedError
from serving.engine.engine_client import EngineDeadError
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
    Shutdown,
    VerifySlots,
    WarmUp,
)
from serving.engine.llm_engine import LLMEngine
from serving.engine.lora.cache import Placement
from serving.engine.outputs import RequestOutput
from serving.engine.stats import EngineStats, LoRAInfo, SlotRepair
from serving.engine.warmup import WarmupReport, warm_up

logger = logging.getLogger(__name__)

# How long the loop sleeps when idle before re-checking; commands and finished adapter loads wake
# it at once, so this only bounds the delay after a missed wake-up.
IDLE_WAIT_S = 1.0

T = TypeVar("T")
R = TypeVar("R")

# ``reply(ok, value)``: a command's answer, its value or (not ``ok``) the exception it raised.
Reply = Callable[[bool, object], None]


class EngineCore:
    """``emit_step(outputs)``: a step's outputs, once per step that produced any, and before them,
    from inside the step, its first outputs (of the requests whose first token it read) in a call
    of their own, made before the step's other tokens are processed (``LLMEngine.step``): the
    process engine sends them in an earlier, small message, so a first token does not wait for the
    step's other outputs to be made, encoded, sent and decoded. ``emit(request_id,
    item)``: one request's output or failure made between steps (an abort, a failed start).
    ``forget(request_id)``: a request dropped without a last output. ``on_dead(error)``: once, when
    the engine can run no more. All are called on the loop's thread."""

    def __init__(self, config: EngineConfig, *, emit_step: Callable[[list[RequestOutput]], None],
                 emit: Callable[[str, RequestOutput | Exception], None],
                 on_dead: Callable[[Exception], None],
                 forget: Callable[[str], None] = lambda request_id: None) -> None:
        self.wake = threading.Event()
        self.engine = LLMEngine(config, on_load_done=self.wake.set)
        self._emit_step = emit_step
        self._emit = emit
        self._forget = forget
        self._on_dead = on_dead
        self._commands: queue.SimpleQueue[tuple[EngineCommand, Reply | None]] = queue.SimpleQueue()
        self.stopping = False
        self.dead: Exception | None = None

    def submit(self, command: EngineCommand, reply: Reply | None = None) -> None:
        """Have ``handle(command, reply)`` run on the loop's thread between two steps (from any thread)."""
        self._commands.put((command, reply))
        self.wake.set()

    def handle(self, command: EngineCommand, reply: Reply | None = None) -> None:
        """Run ``command``'s method (``HANDLERS``) and ``reply`` with what it returned or raised; a
        method that returns a Future (an adapter load) is answered when that completes, without
        holding up the steps meanwhile. A command of no known type is answered with TypeError."""
        handler = self.HANDLERS.get(type(command))
        try:
            if handler is None:
                raise TypeError(f"not an engine command: {type(command).__name__}")
            value = handler(self, command)
        except Exception as exc:
            if reply is None:
                logger.exception("the engine command %s failed", type(command).__name__)
            else:
                reply(False, exc)
            return
        if reply is None:
            return
        if isinstance(value, Future):
            value.add_done_callback(lambda done: _answer(reply, done))
        else:
            reply(True, value)

    # ---- the commands, one method each -----------------------------------------------------

    def add(self, command: AddRequest) -> None:
        """Queue a request; its failure to start is emitted to it (its stream raises it)."""
        # The engine reads a prompt given with its encoding only for its cache_salt.
        prompt: dict[str, Any] = {"prompt_token_ids": command.encoded[1]}
        if command.cache_salt is not None:
            prompt["cache_salt"] = command.cache_salt
        try:
            self.engine.add_request(command.request_id, prompt, command.params, command.lora_request,
                                    command.priority, encoded=command.encoded)
        except Exception as exc:
            self._emit(command.request_id, exc)

    def drop(self, command: DropRequest) -> None:
        self.engine.abort_request(command.request_id)  # a compiling grammar is cancelled with it
        self._forget(command.request_id)

    def abort(self, command: AbortRequest) -> None:
        output = self.engine.abort_request(command.request_id)
        if output is not None:
            self._emit(command.request_id, output)  # before the answer: the stream has ended when abort() returns

    def add_lora(self, command: AddLora) -> Future[LoRAInfo]:
        load = self.engine.add_lora(command.lora_request, command.load_inplace, background=command.background)
        # Read when the load completes, inside a step's poll: on this thread, between steps.
        return _then(load, lambda _: self.engine.list_loras([command.lora_request.lora_name])[0])

    def prefetch_lora(self, command: PrefetchLora) -> Future[Placement]:
        return self.engine.prefetch_lora(command.lora_request, to_gpu=command.to_gpu, keep=command.keep)

    def remove_lora(self, command: RemoveLora) -> None:
        self.engine.remove_lora(command.name)

    def list_loras(self, command: ListLoras) -> list[LoRAInfo]:
        return self.engine.list_loras(command.names)

    def verify_slots(self, command: VerifySlots) -> list[SlotRepair]:
        return self.engine.verify_slots()

    def stats(self, command: GetStats) -> EngineStats:
        return self.engine.stats()

    def warm_up(self, command: WarmUp) -> WarmupReport:
        """Run the warm-up on this thread (no step runs meanwhile), then freeze what it leaves out of
        the collector: it lives as long as the process, and in the engine-core process nothing
        else freezes it (a full collection that walked it took 131-143 ms, a stall of every stream)."""
        report = warm_up(self.engine, command.adapters)
        gc.collect()
        gc.freeze()
        return report

    def stop(self, command: Shutdown) -> None:
        """Abort every request (each emits its ``"abort"`` output) and end the loop."""
        for request_id in self.engine.request_ids():
            output = self.engine.abort_request(request_id)
            if output is not None:
                self._emit(request_id, output)
        self.stopping = True

    # Every command type and the method that runs it: both drivers dispatch through this table.
    HANDLERS: ClassVar[dict[type[Any], Callable[[EngineCore, Any], object]]] = {
        AddRequest: add, DropRequest: drop, AbortRequest: abort, AddLora: add_lora, PrefetchLora: prefetch_lora,
        RemoveLora: remove_lora, ListLoras: list_loras, VerifySlots: verify_slots, GetStats: stats, WarmUp: warm_up,
        Shutdown: stop,
    }

    # ---- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        while not self.stopping:
            self.wake.clear()
            while True:
                try:
                    command, reply = self._commands.get_nowait()
                except queue.Empty:
                    break
                self.handle(command, reply)
                if self.stopping:
                    return
            if self.dead is not None:
                self._fail_all(self.dead)  # a request that came in since: nothing can run it
                self.wake.wait(IDLE_WAIT_S)
                continue
            try:
                outputs = self.engine.step(self._emit_step)
            except Exception as exc:
                logger.exception("engine step failed; failing its requests")
                if isinstance(exc, RankFailedError):
                    # Told before the requests fail: a caller that sees its request fail finds the
                    # engine stopped (the process engine's parent learns it from this message).
                    self.dead = exc
                    self._on_dead(exc)
                self._fail_all(exc)
                continue
            if outputs:
                self._emit_step(outputs)
            if self.engine.last_step_tokens == 0:
                self.wake.wait(IDLE_WAIT_S)

    def _fail_all(self, exc: Exception) -> None:
        error = EngineDeadError(f"the engine step failed: {exc!r}")
        for request_id in self.engine.request_ids():
            try:
                self.engine.abort_request(request_id)
            finally:
                self._emit(request_id, error)


def _then(future: Future[T], fn: Callable[[T], R]) -> Future[R]:
    """A Future of ``fn(future's result)``, computed on the thread that completes ``future``."""
    chained: Future[R] = Future()

    def done(source: Future[T]) -> None:
        try:
            chained.set_result(fn(source.result()))
        except Exception as exc:  # the source's error, or fn's
            chained.set_exception(exc)

    future.add_done_callback(done)
    return chained


def _answer(reply: Reply, done: Future[Any]) -> None:
    error = done.exception()
    if error is None:
        reply(True, done.result())
    else:
        reply(False, error)
