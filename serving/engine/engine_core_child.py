"""The engine-core process: the ``LLMEngine`` and its loop in a child of the serving process.

Why a process: in one process the engine thread and the HTTP event loop share the interpreter lock,
and PyTorch's bindings release and retake it around every op; with the HTTP loop busy, each retake
waits, and the steps are host-bound on the GPU (vLLM V1 moved its engine core into its own process
for the same reason). ``ProcessEngine`` (serving.engine.process_engine) starts ``main`` with
multiprocessing's ``spawn`` context (never ``fork``: a forked CUDA context is unusable) and talks to
it over one duplex pipe. The loop is ``EngineCore``'s, the one ``AsyncEngine`` runs on a thread.

Detokenization stays here, in the engine's output processing: outputs cross the pipe with their
text. Moving it to the parent (vLLM V1 does, in its front end) would take work off the child's
steps but put it back on the process of the HTTP loop; it is left for when measurements say so.

Messages are tuples whose first item names them.

Parent to child:
    ("add", request_id, salt, params, lora_request, priority, encoded)   no answer; a failure to
                                                           start is a "fail" for the request;
                                                           ``salt``: {"cache_salt": ...} or ""
    ("drop", request_id)                                  abort, no answer (its caller left)
    ("call", call_id, method, args)                       answered by one "reply" (``_CALLS``)
    ("load", call_id, method, args)                       an adapter load (``_LOADS``), answered by
                                                           one "reply" when the load completes
    ("shutdown",)                                         abort every request, stop
Child to parent:
    ("ready", model_name, max_model_len) or ("failed", error)   once, when the engine is built
    ("step", outputs)             a step's outputs in one message (or an abort's one output), each
                                  a request's first output whole, then what changed
                                  (serving.engine.output_deltas)
    ("fail", request_id, error)   a request ended by an error outside a step's outputs
    ("forget", request_id)        a request dropped without a last output: its delta state goes
    ("reply", call_id, ok, value)     ``value`` is the result, or the exception when not ``ok``
    ("dead", error)               no step can run again (a tensor-parallel rank died)
"""

from __future__ import annotations

import logging
import logging.config
import pickle
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from serving.engine.config import EngineConfig
from serving.engine.engine_core import EngineCore
from serving.engine.llm_engine import LLMEngine
from serving.engine.output_deltas import OutputEncoder
from serving.engine.outputs import RequestOutput
from serving.wire.logs import logging_config
from serving.wire.settings import platform_settings

logger = logging.getLogger(__name__)
E = TypeVar("E", bound=BaseException)

# Calls answered at once, between two steps: method name -> what runs on the engine.
_CALLS: dict[str, Callable[..., Any]] = {
    "verify_slots": LLMEngine.verify_slots,
    "remove_lora": LLMEngine.remove_lora,
    "list_loras": LLMEngine.list_loras,
    "stats": LLMEngine.stats,
}


def _describe(engine: LLMEngine, args: tuple[Any, ...], result: object) -> object:
    """An added adapter's LoRAInfo, read when its load completes (inside a step's poll)."""
    (info,) = engine.list_loras([args[0].lora_name])
    return info


# Loads: method name -> (what starts the load, what turns its result into the answer).
_LOADS: dict[str, tuple[Callable[..., Future[Any]], Callable[[LLMEngine, tuple[Any, ...], Any], object]]] = {
    "add_lora": (lambda engine, request, inplace, background: engine.add_lora(request, inplace, background=background),
                 _describe),
    "prefetch_lora": (lambda engine, request, to_gpu, keep: engine.prefetch_lora(request, to_gpu=to_gpu, keep=keep),
                      lambda engine, args, placement: placement),
}


def portable(error: E) -> E | RuntimeError:
    """``error`` when it survives pickling, else a RuntimeError that says what it was: an error the
    parent cannot unpickle would break its reader, and with it every request."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


class _Channel:
    """The child's end of the pipe. Sends come from the loop's thread (a load completes inside a
    step's poll, so its answer too); the lock keeps messages whole should a future's callback
    ever run on the thread that completed it."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()
        self.encoder = OutputEncoder()  # used on the loop's thread only

    def send(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            try:
                self.conn.send(message)
            except OSError:
                pass  # the parent is gone; the listener sees the pipe close and stops the loop

    def step(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.error is not None:
                output.error = portable(output.error)
        self.send(("step", self.encoder.encode(outputs)))

    def emit(self, request_id: str, item: RequestOutput | Exception) -> None:
        if isinstance(item, RequestOutput):
            self.step([item])
        else:
            self.encoder.forget(request_id)
            self.send(("fail", request_id, portable(item)))

    def reply(self, call_id: int, ok: bool, value: object) -> None:
        try:
            self.send(("reply", call_id, ok, portable(value) if isinstance(value, BaseException) else value))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # nothing was written: say so instead
            logger.exception("the answer to call %d cannot be pickled", call_id)
            self.send(("reply", call_id, False, RuntimeError(f"the engine's answer cannot be sent: {exc!r}")))


class _Commands:
    """Turns the parent's messages into commands the loop runs between steps."""

    def __init__(self, core: EngineCore, channel: _Channel) -> None:
        self.core = core
        self.engine = core.engine
        self.channel = channel

    def listen(self) -> None:
        """On a thread of its own, so the pipe drains while a step runs (the parent never blocks
        on a full pipe) and a message wakes an idle loop at once."""
        while True:
            try:
                message = self.channel.conn.recv()
            except (EOFError, OSError):
                logger.warning("the serving process closed the pipe; stopping the engine")
                self.core.submit(self.core.stop)
                return
            if message[0] == "shutdown":
                self.core.submit(self.core.stop)
                return
            self.core.submit(partial(self.run, message))

    def run(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "add":
            _, request_id, prompt, params, lora_request, priority, encoded = message
            try:
                self.engine.add_request(request_id, prompt, params, lora_request, priority, encoded=encoded)
            except Exception as exc:  # the caller's: its stream raises it
                self.channel.emit(request_id, exc)
        elif kind == "drop":
            self.engine.abort_request(message[1])
            if self.channel.encoder.forget(message[1]):
                self.channel.send(("forget", message[1]))
        elif kind == "call":
            self.call(*message[1:])
        elif kind == "load":
            self.load(*message[1:])
        else:
            logger.error("unknown message from the serving process: %r", kind)

    def call(self, call_id: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            value: object = None
            if method == "abort":
                self.abort(*args)
            else:
                value = _CALLS[method](self.engine, *args)
        except Exception as exc:
            self.channel.reply(call_id, False, exc)
        else:
            self.channel.reply(call_id, True, value)

    def abort(self, request_id: str) -> None:
        output = self.engine.abort_request(request_id)
        if output is not None:
            self.channel.emit(request_id, output)  # before the reply: the stream has ended when abort() returns

    def load(self, call_id: int, method: str, args: tuple[Any, ...]) -> None:
        """Start a load and answer when it completes, without holding up the steps meanwhile."""
        start, then = _LOADS.get(method, (None, None))
        if start is None or then is None:
            self.channel.reply(call_id, False, ValueError(f"no such load: {method!r}"))
            return

        def done(load: Future[Any]) -> None:
            error = load.exception()
            if error is not None:
                self.channel.reply(call_id, False, error)
                return
            try:
                value = then(self.engine, args, load.result())
            except Exception as exc:
                self.channel.reply(call_id, False, exc)
            else:
                self.channel.reply(call_id, True, value)

        try:
            start(self.engine, *args).add_done_callback(done)
        except Exception as exc:
            self.channel.reply(call_id, False, exc)


def _ignore_signal(signum: int, frame: object) -> None:
    logger.info("%s ignored: the serving process stops the engine", signal.Signals(signum).name)


def main(config: EngineConfig, conn: Connection) -> None:
    """The child's entry point: build the engine, say so, run the loop until told to stop or the
    parent goes away, then shut the engine down (its tensor-parallel ranks with it)."""
    # Ctrl-C in a terminal reaches the whole process group, and a service manager's stop may send
    # SIGTERM to every process of the service; the parent decides when the engine stops (after
    # its drain), so the child ignores both and waits for "shutdown" or a closed pipe. A handler,
    # not SIG_IGN, which the tensor-parallel ranks it starts would inherit (their stop is SIGTERM).
    signal.signal(signal.SIGINT, _ignore_signal)
    signal.signal(signal.SIGTERM, _ignore_signal)
    settings = platform_settings()  # the environment the parent had: its log lines look like the parent's
    logging.config.dictConfig(logging_config(settings.log_format, settings.log_level))
    channel = _Channel(conn)
    try:
        core = EngineCore(config, emit_step=channel.step, emit=channel.emit,
                          on_dead=lambda error: channel.send(("dead", portable(error))))
    except Exception as exc:
        logger.exception("the engine could not start")
        channel.send(("failed", portable(exc)))
        conn.close()
        return
    channel.send(("ready", core.engine.model_name, core.engine.max_model_len))
    threading.Thread(target=_Commands(core, channel).listen, name="engine-core-listener", daemon=True).start()
    try:
        core.run()
    finally:
        core.engine.shutdown()
        conn.close()
