"""The engine loop: one thread owns an ``LLMEngine``, runs commands between steps and steps back to
back while there is work, and hands each step's outputs to whoever listens.

``AsyncEngine`` runs it on a thread of the serving process and delivers outputs to its callers'
event loops; the engine-core child process (serving.engine.engine_core_child) runs it on its main
thread and sends outputs down a pipe. One loop, so both engines schedule, fail and stop alike.

A step that fails fails its requests and the loop goes on, except when a tensor-parallel rank died
(``RankFailedError``): no step can run again, so from then on every request fails at once and
``on_dead`` tells the owner.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from serving.engine.config import EngineConfig
from serving.engine.distributed.parallel import RankFailedError
from serving.engine.engine_client import EngineDeadError
from serving.engine.llm_engine import LLMEngine
from serving.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

# How long the loop sleeps when idle before re-checking; commands and finished adapter loads wake
# it at once, so this only bounds the delay after a missed wake-up.
IDLE_WAIT_S = 1.0


class EngineCore:
    """``emit_step(outputs)``: a step's outputs, once per step that produced any. ``emit(request_id,
    item)``: one request's output or failure made between steps (an abort, a failed start).
    ``on_dead(error)``: once, when the engine can run no more. All three are called on the loop's
    thread."""

    def __init__(self, config: EngineConfig, *, emit_step: Callable[[list[RequestOutput]], None],
                 emit: Callable[[str, RequestOutput | Exception], None],
                 on_dead: Callable[[Exception], None]) -> None:
        self.wake = threading.Event()
        self.engine = LLMEngine(config, on_load_done=self.wake.set)
        self._emit_step = emit_step
        self._emit = emit
        self._on_dead = on_dead
        self._commands: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self.stopping = False
        self.dead: Exception | None = None

    def submit(self, command: Callable[[], object]) -> None:
        """Run ``command`` on the loop's thread between two steps (from any thread)."""
        self._commands.put(command)
        self.wake.set()

    def stop(self) -> None:
        """A command: abort every request (each emits its ``"abort"`` output) and end the loop."""
        for request_id in self.engine.request_ids():
            output = self.engine.abort_request(request_id)
            if output is not None:
                self._emit(request_id, output)
        self.stopping = True

    def run(self) -> None:
        while not self.stopping:
            self.wake.clear()
            while True:
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
                if self.stopping:
                    return
            if self.dead is not None:
                self._fail_all(self.dead)  # a request that came in since: nothing can run it
                self.wake.wait(IDLE_WAIT_S)
                continue
            try:
                outputs = self.engine.step()
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
