"""``ProcessEngine``: the asyncio face of ``AsyncEngine`` over an engine core in a child process.

The ``LLMEngine`` and its loop run in the engine-core process (serving.engine.engine_core_child
says why, and what crosses the pipe), so its steps never wait for the interpreter lock this
process's HTTP loop holds. Here, transport only: each call's command (serving.engine.engine_messages,
the ones ``AsyncEngine`` hands its thread) down the pipe, and one reader thread that takes every
message the child sends and delivers it, a step's outputs in one hop per caller event loop
(serving.engine.engine_client, which ``AsyncEngine`` shares).

Prompts are encoded and checked here, with this process's own tokenizer and model config (both
cheap to load), so a bad prompt fails before anything crosses the pipe, and the child gets the
token ids. Text comes back already detokenized by the child; a request's outputs cross as what
changed since its last one and are made cumulative again here (serving.engine.output_deltas).

The child dying (killed, crashed, out of memory) is seen by the reader as the pipe's end: from then
on the engine is not running, every open stream and pending call fails with EngineDeadError, and
``on_dead`` is called once, as it is when a tensor-parallel rank dies under the child.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import threading
from collections.abc import Callable
from multiprocessing.connection import wait as wait_connections
from typing import Any

from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from serving.engine import engine_core_child
from serving.engine.config import EngineConfig
from serving.engine.engine_client import EngineClient, EngineDeadError, settle_error, settle_from_thread
from serving.engine.engine_messages import EngineCommand, Shutdown
from serving.engine.output_deltas import OutputDecoder
from serving.engine.prompts import PromptType, encode_prompt, validate_prompt
from serving.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long the reader waits, once the pipe ended, for the child's exit code to name in the error.
_EXIT_CODE_WAIT_S = 5.0


class ProcessEngine(EngineClient):
    def __init__(self, config: EngineConfig, *, on_dead: Callable[[Exception], None] = lambda error: None) -> None:
        """Start the engine-core process and return once its engine is built; raises what building
        it raised (ValueError for a bad setting, ...), or EngineDeadError if the child died first.
        ``on_dead(error)`` is called once, on the reader thread, if the engine can run no more."""
        super().__init__()
        self._config = config
        self._on_dead = on_dead
        self._tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(config.model)
        self._vocab_size = int(AutoConfig.from_pretrained(config.model).vocab_size)
        context = multiprocessing.get_context("spawn")  # fork would copy a CUDA context, unusable
        self._conn, child_conn = context.Pipe()
        # Not a daemon: a daemon may not start children, and a tensor-parallel engine spawns its ranks.
        self._process = context.Process(target=engine_core_child.main, args=(config, child_conn), name="engine-core")
        self._process.start()
        child_conn.close()  # the child's copy is its own: the pipe ends when the child does
        try:
            self._model_name, self._max_model_len = self._await_ready()
        except BaseException:
            self._kill()
            self._conn.close()
            raise
        self._send_lock = threading.Lock()
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._call_ids = itertools.count()
        self._dead: Exception | None = None
        self._stopping = False
        self._closed = False
        self._decoder = OutputDecoder()  # the reader thread's
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._reader.start()
        # multiprocessing joins non-daemon children at exit; an engine left running would hang it.
        atexit.register(self.shutdown)

    @classmethod
    def from_args(cls, model: str, **kwargs: Any) -> ProcessEngine:
        """``ProcessEngine.from_args(PATH, max_loras=..., ...)``: any ``EngineConfig`` field."""
        return cls(EngineConfig(model=model, **kwargs))

    @property
    def pid(self) -> int | None:
        """The engine-core process's id."""
        return self._process.pid

    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._stopping and self._process.is_alive()

    # ---- requests -------------------------------------------------------------------------

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return encode_prompt(self._tokenizer, prompt)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(token_ids, params, vocab=self._vocab_size, max_model_len=self._max_model_len,
                        max_num_seqs=self._config.max_num_seqs)

    # ---- life cycle -----------------------------------------------------------------------

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every request (their streams end with ``"abort"``), stop the engine-core process
        and wait for it; killed when it has not ended within ``timeout``. No process is left."""
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        atexit.unregister(self.shutdown)
        try:
            self._send((None, Shutdown()))
        except EngineDeadError:
            pass  # already gone
        self._process.join(timeout)
        if self._process.is_alive():
            logger.warning("the engine-core process did not stop within %.1fs; killing it", timeout)
            self._kill()
        self._reader.join(timeout)  # it ends at the pipe's end, which the child's exit is
        self._conn.close()

    def _kill(self) -> None:
        self._process.kill()
        self._process.join()

    # ---- the pipe -------------------------------------------------------------------------

    def _await_ready(self) -> tuple[str, int]:
        ready = wait_connections([self._conn, self._process.sentinel])
        message: tuple[Any, ...] | None = None
        if self._conn in ready:
            try:
                message = self._conn.recv()
            except EOFError:
                message = None
        if message is None:
            self._process.join(_EXIT_CODE_WAIT_S)
            raise EngineDeadError(f"the engine-core process exited while starting (exit code {self._process.exitcode})")
        if message[0] == "failed":
            self._process.join(_EXIT_CODE_WAIT_S)
            raise message[1]
        _, model_name, max_model_len = message
        return str(model_name), int(max_model_len)

    def _send(self, message: tuple[int | None, EngineCommand]) -> None:
        """Callers' threads send; one lock keeps messages whole."""
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError) as exc:  # a broken or closed pipe: the child is gone
                raise EngineDeadError(f"the engine-core process is gone: {exc!r}") from exc

    def _submit(self, command: EngineCommand) -> None:
        self._send((None, command))

    async def _call(self, command: EngineCommand) -> Any:
        """Send ``command`` and await its answer (which the reader settles on this event loop)."""
        loop = asyncio.get_running_loop()
        result: asyncio.Future[Any] = loop.create_future()
        with self._lock:  # the lock _die takes: a call is either registered before, or refused
            self._check_alive()
            call_id = next(self._call_ids)
            self._calls[call_id] = (loop, result)
        try:
            self._send((call_id, command))
        except EngineDeadError:
            with self._lock:
                self._calls.pop(call_id, None)
            raise
        return await result

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self._dead}")
        if self._stopping:
            raise EngineDeadError("the engine is shut down")

    def _read(self) -> None:
        """The reader thread: every message from the child, until the pipe ends."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # an unreadable message; what it answered can no longer be told
                logger.exception("unreadable message from the engine-core process")
                continue
            kind = message[0]
            if kind == "step":
                self._deliver_step(self._decoder.decode(message[1]))
            elif kind == "fail":
                self._decoder.forget(message[1])
                self._deliver(message[1], message[2])
            elif kind == "forget":
                self._decoder.forget(message[1])
            elif kind == "reply":
                self._settle(*message[1:])
            elif kind == "dead":
                self._die(message[1], fail=False)  # the child failed its requests and fails new ones
        if self._stopping:
            self._die(EngineDeadError("the engine is shut down"), notify=False)
            return
        self._process.join(_EXIT_CODE_WAIT_S)
        self._die(EngineDeadError(f"the engine-core process exited (exit code {self._process.exitcode})"))

    def _settle(self, call_id: int, ok: bool, value: object) -> None:
        with self._lock:
            target = self._calls.pop(call_id, None)
        if target is not None:
            settle_from_thread(*target, ok, value)

    def _die(self, error: Exception, *, fail: bool = True, notify: bool = True) -> None:
        """The engine can run no more: refuse new work; with ``fail``, end every open stream and
        pending call with EngineDeadError; with ``notify``, tell the owner (once)."""
        with self._lock:
            first = self._dead is None
            if first:
                self._dead = error
            calls = list(self._calls.values()) if fail else []
            if fail:
                self._calls.clear()
        if fail:
            dead = error if isinstance(error, EngineDeadError) else EngineDeadError(f"the engine has stopped: {error}")
            for loop, future in calls:
                try:
                    loop.call_soon_threadsafe(settle_error, future, dead)
                except RuntimeError:
                    pass  # the caller's event loop is closed
            self._fail_streams(dead)
        if first and notify:
            logger.error("the engine can run no more: %s", error)
            self._on_dead(error)
