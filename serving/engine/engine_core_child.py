"""The engine-core process: the ``LLMEngine`` and its loop in a child of the serving process.

Why a process: in one process the engine thread and the HTTP event loop share the interpreter lock,
and PyTorch's bindings release and retake it around every op; with the HTTP loop busy, each retake
waits, and the steps are host-bound on the GPU (vLLM V1 moved its engine core into its own process
for the same reason). ``ProcessEngine`` (serving.engine.process_engine) starts ``main`` with
multiprocessing's ``spawn`` context (never ``fork``: a forked CUDA context is unusable) and talks to
it over one duplex pipe. The loop and the commands are ``EngineCore``'s, the ones ``AsyncEngine``
runs on a thread: this module only carries them (a listener thread that submits what the pipe
brings, a channel that sends back what the core emits and answers).

Detokenization stays here, in the engine's output processing: outputs cross the pipe with their
text. Moving it to the parent (vLLM V1 does, in its front end) would take work off the child's
steps but put it back on the process of the HTTP loop; it is left for when measurements say so.

Parent to child: ``(call_id, command)``, a command of serving.engine.engine_messages; ``call_id``
is None for a command sent without waiting (add, drop, shutdown), else its one "reply" names it.
Child to parent, tuples whose first item names them (a step's outputs cross once per step, its
first outputs ahead of them; a tuple pickles several times cheaper than a dataclass):
    ("ready", model_name, max_model_len) or ("failed", error)   once, when the engine is built
    ("step", outputs)             a step's outputs in one message (or an abort's one output), each
                                  a request's first output whole, then what changed
                                  (serving.engine.output_deltas); a step that read first tokens
                                  sends their outputs first in a message of their own, made before
                                  the step's other tokens were processed (EngineCore), and the
                                  step's message has the rest: no request is in both
    ("fail", request_id, error)   a request ended by an error outside a step's outputs
    ("forget", request_id)        a request dropped without a last output: its delta state goes
    ("reply", call_id, ok, value)     ``value`` is the answer, or the exception when not ``ok``
    ("dead", error)               no step can run again (a tensor-parallel rank died)
"""

from __future__ import annotations

import logging
import logging.config
import pickle
import signal
import threading
from functools import partial
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from serving.engine.config import EngineConfig
from serving.engine.engine_core import EngineCore
from serving.engine.engine_messages import Shutdown
from serving.engine.output_deltas import OutputEncoder
from serving.engine.outputs import RequestOutput
from runtime.logs import logging_config
from runtime.settings import platform_settings

logger = logging.getLogger(__name__)
E = TypeVar("E", bound=BaseException)


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

    def forget(self, request_id: str) -> None:
        if self.encoder.forget(request_id):
            self.send(("forget", request_id))

    def reply(self, call_id: int, ok: bool, value: object) -> None:
        try:
            self.send(("reply", call_id, ok, portable(value) if isinstance(value, BaseException) else value))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # nothing was written: say so instead
            logger.exception("the answer to call %d cannot be pickled", call_id)
            self.send(("reply", call_id, False, RuntimeError(f"the engine's answer cannot be sent: {exc!r}")))


def _listen(core: EngineCore, channel: _Channel) -> None:
    """On a thread of its own, so the pipe drains while a step runs (the parent never blocks on a
    full pipe) and a command wakes an idle loop at once."""
    while True:
        try:
            call_id, command = channel.conn.recv()
        except (EOFError, OSError):
            logger.warning("the serving process closed the pipe; stopping the engine")
            core.submit(Shutdown())
            return
        core.submit(command, None if call_id is None else partial(channel.reply, call_id))
        if isinstance(command, Shutdown):
            return


def _ignore_signal(signum: int, frame: object) -> None:
    logger.info("%s ignored: the serving process stops the engine", signal.Signals(signum).name)


def main(config: EngineConfig, conn: Connection) -> None:
    """The child's entry point: build the engine, say so, run the loop until told to stop or the
    parent goes away, then shut the engine down (its tensor-parallel ranks with it)."""
    # Ctrl-C in a terminal reaches the whole process group, and a service manager's stop may send
    # SIGTERM to every process of the service; the parent decides when the engine stops (after
    # its drain), so the child ignores both and waits for Shutdown or a closed pipe. A handler,
    # not SIG_IGN, which the tensor-parallel ranks it starts would inherit (their stop is SIGTERM).
    signal.signal(signal.SIGINT, _ignore_signal)
    signal.signal(signal.SIGTERM, _ignore_signal)
    settings = platform_settings()  # the environment the parent had: its log lines look like the parent's
    logging.config.dictConfig(logging_config(settings.log_format, settings.log_level))
    channel = _Channel(conn)
    try:
        core = EngineCore(config, emit_step=channel.step, emit=channel.emit, forget=channel.forget,
                          on_dead=lambda error: channel.send(("dead", portable(error))))
    except Exception as exc:
        logger.exception("the engine could not start")
        channel.send(("failed", portable(exc)))
        conn.close()
        return
    channel.send(("ready", core.engine.model_name, core.engine.max_model_len))
    threading.Thread(target=_listen, args=(core, channel), name="engine-core-listener", daemon=True).start()
    try:
        core.run()
    finally:
        core.engine.shutdown()
        conn.close()
