"""The engine's grammar compilation as a shared resource with a per-tenant share (issue 37): a pool
of compiling processes (serving.engine.grammar_worker) fed from a queue that is fair between
tenants, each compile held to a time budget.

- **Fair queue** (``FairQueue``): one FIFO queue per tenant, served in turn (round-robin), so a
  tenant's compile waits behind at most one compile of each other tenant, never behind another
  tenant's whole queue; and a tenant runs at most ``share`` compiles at once (default: one worker
  fewer than the pool), so with two or more workers one is always left for the other tenants: a
  new small schema starts at once while a tenant's huge one compiles.
- **Time budget**: a compile running past ``timeout`` seconds is stopped by killing its process (a
  C++ compile cannot be interrupted on a thread); its future fails with GrammarTooComplex and the
  pool starts another process. Time counts from the task's dispatch, not from its wait in queue.
- **Cancellation** (``cancel``): a task whose requests all left is taken out of its queue, or, when
  running, its process is killed.
- **A killed process's replacement is its tenant's**: a process killed while it compiled a tenant's
  task (past its time, cancelled, crashed) is replaced at once, and the replacement counts in that
  tenant's share until it is ready (a fork of the pool's forker: milliseconds). Freed at the kill,
  the share would let the same tenant's next compile take the one ready process while the
  replacement still starts, and another tenant's new small schema would wait for that start; so a
  tenant whose compiles keep running past their time waits for its own restarts, and the pool's
  other ready process stays free for the others (docs/security.md, "Grammar compilation").

The tokenizer's table and the processes are built on the pool's thread at the first ``submit``
(seconds at a 128k vocabulary; an engine that serves no constraint never pays). ``submit`` and
``cancel`` never block on a compile: the engine's step calls them.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from serving.engine import forker
from serving.engine.grammar_worker import CompileLimits

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The `serving` package's root, for the processes' import path.
_SOURCE_ROOT = str(Path(__file__).resolve().parents[2])
# Processes in a row that may end before they are ready (a broken install) before the pool gives up.
_MAX_FAILED_STARTS = 3


@dataclass(frozen=True)
class GrammarBudget:
    """What compiling one request's constraint may cost, and the pool and cache that do it
    (EngineConfig.grammar; docs/security.md, "Grammar compilation", says why each value).

    Checked before a compile is queued: ``max_schema_depth`` (a JSON schema's nesting, in JSON
    levels: a schema level under ``properties`` is two; the library's conversion is superlinear in
    it) and ``max_constraint_bytes`` (a schema's, regex's or choice list's text). Checked while it
    compiles: ``timeout`` seconds, ``max_grammar_bytes`` of EBNF (a caller's grammar, or what a
    schema becomes), ``max_compiled_bytes`` of compiled grammar and ``max_compile_memory_bytes``
    of memory a compiling process may take beyond its own. ``workers`` processes compile,
    a tenant using at most ``tenant_share`` of them at once (None: one fewer than ``workers``, at
    least one). Each tenant's compiled grammars are cached, at most ``cache_entries`` a tenant and
    ``cache_bytes`` in all."""

    timeout: float = 5.0
    workers: int = 2
    tenant_share: int | None = None
    max_schema_depth: int = 64
    max_constraint_bytes: int = 256 << 10
    max_grammar_bytes: int = 4 << 20
    max_compiled_bytes: int = 128 << 20
    max_compile_memory_bytes: int = 1 << 30
    cache_entries: int = 64
    cache_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        numbers = {name: getattr(self, name) for name in ("timeout", "workers", "max_schema_depth",
                                                          "max_constraint_bytes", "max_grammar_bytes",
                                                          "max_compiled_bytes", "max_compile_memory_bytes",
                                                          "cache_entries", "cache_bytes")}
        for name, value in numbers.items():
            if value <= 0:
                raise ValueError(f"grammar budget: {name} must be > 0, got {value}")
        if self.tenant_share is not None and not 1 <= self.tenant_share <= self.workers:
            raise ValueError(f"grammar budget: tenant_share must be in 1..workers ({self.workers}), got {self.tenant_share}")

    @property
    def share(self) -> int:
        return self.tenant_share if self.tenant_share is not None else max(1, self.workers - 1)

    @property
    def limits(self) -> CompileLimits:
        return CompileLimits(max_grammar_bytes=self.max_grammar_bytes, max_compiled_bytes=self.max_compiled_bytes,
                             max_compile_memory_bytes=self.max_compile_memory_bytes)


class GrammarError(ValueError):
    """A constraint the grammar library cannot compile; the message names the construct."""

    code: str | None = None


class GrammarTooComplex(GrammarError):
    """A constraint past this worker's compile budget (time, nesting, size): a 400 with this code."""

    code = "grammar_too_complex"


class FairQueue(Generic[T]):
    """Per-tenant FIFO queues served round-robin; a tenant has at most ``share`` items running.
    Not thread-safe (the pool holds its lock around it)."""

    def __init__(self, share: int) -> None:
        if share < 1:
            raise ValueError(f"a tenant's share must be >= 1, got {share}")
        self.share = share
        # Tenants with queued items, in the order of their turn.
        self._queues: OrderedDict[str, deque[T]] = OrderedDict()
        self._running: Counter[str] = Counter()

    def push(self, tenant: str, item: T) -> None:
        self._queues.setdefault(tenant, deque()).append(item)

    def push_front(self, tenant: str, item: T) -> None:
        """Queue `item` ahead of `tenant`'s others (one taken back from a process that died under it)."""
        self._queues.setdefault(tenant, deque()).appendleft(item)

    def remove(self, tenant: str, item: T) -> bool:
        """Take a queued `item` out; False if it is not queued."""
        queue = self._queues.get(tenant)
        if queue is None or item not in queue:
            return False
        queue.remove(item)
        if not queue:
            del self._queues[tenant]
        return True

    def pop(self) -> tuple[str, T] | None:
        """The next item to run, counted as running: the first tenant in turn below its share; that
        tenant's turn moves to the back. None when every tenant with items is at its share."""
        for tenant in self._queues:
            if self._running[tenant] >= self.share:
                continue
            queue = self._queues.pop(tenant)
            item = queue.popleft()
            if queue:
                self._queues[tenant] = queue
            self._running[tenant] += 1
            return tenant, item
        return None

    def finished(self, tenant: str) -> None:
        """One of `tenant`'s running items ended (done, failed, killed)."""
        self._running[tenant] -= 1
        if self._running[tenant] <= 0:
            del self._running[tenant]

    def running(self, tenant: str) -> int:
        return self._running[tenant]

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())


@dataclass(eq=False)
class _Task:
    tenant: str
    kind: str
    text: str
    label: str  # what the caller sent, for messages: "JSON schema", "regex", …
    future: Future[xgrammar.CompiledGrammar] = field(default_factory=Future)
    deadline: float | None = None  # set at dispatch


@dataclass(eq=False)
class _Process:
    conn: Connection
    pid: int | None = None  # told in its ready message
    ready: bool = False
    task: _Task | None = None
    retired: bool = False  # killed on purpose (deadline, cancel, close): its end is not a crash
    # The tenant whose killed compile this process replaces: its share holds this process until ready.
    charged: str | None = None
    # The process that forked it: where that one has ended, this one's end is its forker's death,
    # not a crash on its task.
    forker: subprocess.Popen[bytes] | None = None


class GrammarPool:
    """``budget.workers`` compiling processes, a FairQueue of ``budget.share`` per tenant,
    ``budget.timeout`` seconds a compile. ``tokenizer_info`` builds the library's tokenizer table (once, on the pool's thread).
    ``on_done`` is called after each future settles (to wake the engine's loop). ``command`` starts
    the process that forks the compiling ones (serving.engine.forker), given its socket's
    descriptor (tests start another program)."""

    def __init__(self, tokenizer_info: Callable[[], xgrammar.TokenizerInfo], budget: GrammarBudget, *,
                 on_done: Callable[[], None] = lambda: None,
                 command: Sequence[str] = (sys.executable, "-m", "serving.engine.grammar_worker")) -> None:
        self._tokenizer_info = tokenizer_info
        self._size = budget.workers
        self._timeout = budget.timeout
        self._limits = budget.limits
        self._on_done = on_done
        self._command = list(command)
        self._lock = threading.Lock()
        self._queue: FairQueue[_Task] = FairQueue(budget.share)
        self._tasks: dict[Future[Any], _Task] = {}
        self._processes: list[_Process] = []
        # The process the compiling ones are forked from, and its control socket (the pool's thread's).
        self._forker: subprocess.Popen[bytes] | None = None
        self._control: Connection | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._info: xgrammar.TokenizerInfo | None = None
        # The table, serialized, in a file each process reads when it starts (3.6 MB at 128k: sent
        # down its socket it would hold this thread until the process had imported the library).
        self._info_file: Path | None = None
        self._start_error: Exception | None = None
        self._failed_starts = 0  # processes in a row that ended before they were ready
        # Tenants whose compile's process was killed, each charged for the next process started.
        self._owed: deque[str] = deque()

    # ---- the engine's side -----------------------------------------------------------------

    def submit(self, tenant: str, kind: str, text: str, label: str) -> Future[xgrammar.CompiledGrammar]:
        """Queue one compile (GuidedDecodingParams.key's kind and text) in `tenant`'s queue."""
        task = _Task(tenant, kind, text, label)
        task.future.add_done_callback(lambda _: self._on_done())
        with self._lock:
            if self._closed or self._start_error is not None:
                error = self._start_error or RuntimeError("the grammar pool is shut down")
                task.future.set_exception(error)
                return task.future
            self._tasks[task.future] = task
            self._queue.push(tenant, task)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="grammar-pool", daemon=True)
                self._thread.start()
        self._wake()
        return task.future

    def cancel(self, future: Future[Any]) -> None:
        """Drop a compile nobody waits for: out of its queue, or its process killed if it runs."""
        with self._lock:
            task = self._tasks.pop(future, None)
            if task is None:
                return
            if not self._queue.remove(task.tenant, task):
                for process in self._processes:
                    if process.task is task:
                        self._retire(process)
        future.cancel()
        self._wake()

    def running_pids(self) -> list[int]:
        """The processes compiling now (for tests and /metrics-like probes)."""
        with self._lock:
            return [p.pid for p in self._processes if p.task is not None and p.pid is not None]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pending = list(self._tasks.values())
            self._tasks.clear()
            for process in self._processes:
                self._retire(process)
            if self._info_file is not None:  # here too: a process's exit does not wait for the thread
                self._info_file.unlink(missing_ok=True)
        for task in pending:
            task.future.cancel()
        self._wake()

    # ---- the pool's thread -----------------------------------------------------------------

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # the buffer is full: the thread is woken already
            pass

    def _run(self) -> None:
        try:
            self._info = self._tokenizer_info()
            with tempfile.NamedTemporaryFile("w", prefix="loraplex-tokenizer-", suffix=".json", delete=False) as file:
                file.write(self._info.serialize_json())
            with self._lock:
                self._info_file = Path(file.name)
                if self._closed:  # closed while the table was built
                    self._info_file.unlink()
                    return
        except Exception as exc:
            logger.exception("the grammar compiler's tokenizer table could not be built")
            self._fail_all(RuntimeError(f"grammar compilation is unavailable: {exc}"))
            return
        try:
            self._serve()
        except Exception as exc:  # a bug: the requests waiting must not wait forever
            logger.exception("the grammar pool stopped")
            self._fail_all(RuntimeError(f"grammar compilation failed: {exc}"))
            self.close()
        finally:
            with self._lock:
                self._reap_and_spawn()
                self._info_file.unlink(missing_ok=True)
            self._stop_forker()

    def _serve(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    break
                self._reap_and_spawn()
                self._dispatch()
                conns: list[Any] = [p.conn for p in self._processes if not p.retired]
                if self._control is not None:
                    conns.append(self._control)
                deadlines = [p.task.deadline for p in self._processes if p.task is not None and p.task.deadline]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            for ready in wait([*conns, self._wake_r], timeout):
                if ready is self._wake_r:
                    self._wake_r.recv(4096)
                elif ready is self._control:  # it never writes: readable, its end has closed
                    self._forker_ended()
                else:
                    self._receive(ready)
            self._expire()

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            self._start_error = error
            pending = list(self._tasks.values())
            self._tasks.clear()
        for task in pending:
            _settle(task.future, error=error)

    def _reap_and_spawn(self) -> None:
        """Forget retired processes (the forker has been told to kill those that were compiling; one
        not yet ready ends when its socket closes); start processes up to the pool's size."""
        for process in [p for p in self._processes if p.retired]:
            process.conn.close()
            self._processes.remove(process)
        alive = [p for p in self._processes if not p.retired]
        while not self._closed and len(alive) < self._size:
            alive.append(self._spawn())

    def _spawn(self) -> _Process:
        """Ask the forker for a compiling process (starting the forker if there is none): ready when
        it says so on its socket. If the forker is dying, the socket closes unread: a failed start."""
        if self._control is None:
            self._start_forker()
        assert self._control is not None and self._forker is not None
        ours, theirs = socket.socketpair()
        try:
            forker.spawn(self._control, theirs.fileno(), self._forker.pid)
        except OSError:  # it died: its control socket reads as closed, and this process's as a failed start
            pass
        theirs.close()
        process = _Process(Connection(ours.detach()), charged=self._owed.popleft() if self._owed else None,
                           forker=self._forker)
        self._processes.append(process)
        return process

    def _start_forker(self) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_SOURCE_ROOT, os.environ.get("PYTHONPATH")]))}
        self._forker = subprocess.Popen([*self._command, str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env,
                                        stdin=subprocess.DEVNULL)
        theirs.close()
        self._control = Connection(ours.detach())
        self._control.send(("init", str(self._info_file), self._limits))

    def _forker_ended(self) -> None:
        """The forker's control socket closed: it died, and its processes with it (their sockets close
        too, read as crashes or failed starts); the next spawn starts another."""
        with self._lock:
            if self._control is None or self._forker is None:
                return
            logger.error("the grammar pool's forking process ended unexpectedly (exit code %s)", self._forker.wait())
            self._control.close()
            self._control = self._forker = None

    def _stop_forker(self) -> None:
        """Close the forker's control socket: it leaves its loop and exits, its processes with it."""
        with self._lock:
            control, process = self._control, self._forker
            self._control = self._forker = None
        if control is not None:
            control.close()
        if process is not None:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _dispatch(self) -> None:
        for process in self._processes:
            if not process.ready or process.retired or process.task is not None:
                continue
            picked = self._queue.pop()
            if picked is None:
                return
            _, task = picked
            task.deadline = time.monotonic() + self._timeout
            process.task = task
            try:
                process.conn.send(("compile", id(task), task.kind, task.text))
            except OSError:  # it died meanwhile: its end is read as a crash, which fails the task
                pass

    def _receive(self, conn: Any) -> None:
        with self._lock:
            process = next((p for p in self._processes if p.conn is conn), None)
        if process is None:
            return
        try:
            message = conn.recv()
        except (EOFError, OSError):
            self._ended(process)
            return
        if message[0] == "ready":
            with self._lock:
                process.ready = True
                process.pid = message[1]
                self._failed_starts = 0
                if process.charged is not None:
                    self._queue.finished(process.charged)
                    process.charged = None
            return
        with self._lock:
            task = process.task
            process.task = None
            if task is None or message[1] != id(task):
                return  # an answer to a task cancelled meanwhile
            self._queue.finished(task.tenant)
            self._tasks.pop(task.future, None)
        if message[0] == "ok":
            assert self._info is not None
            import xgrammar as xgr

            try:
                # At a 128k vocabulary a typical schema's is 2.7 MB of JSON, read in 65 ms (docs/serving-worker.md).
                compiled = xgr.CompiledGrammar.deserialize_json(message[2], self._info)
            except Exception as exc:  # the pool's thread must go on serving the other tenants
                logger.exception("a compiled grammar could not be read back from its process")
                _settle(task.future, error=RuntimeError(f"the compiled {task.label} could not be read back: {exc}"))
                return
            _settle(task.future, result=compiled)
            return
        _, _, too_complex, detail = message
        if too_complex:
            _settle(task.future, error=GrammarTooComplex(f"the {task.label} is too complex for this worker: {detail}"))
        else:
            _settle(task.future, error=GrammarError(f"the {task.label} cannot be used for guided decoding: {detail}"))

    def _ended(self, process: _Process) -> None:
        """A process's pipe closed: a retired one was killed; one whose forker has ended died with it,
        and its task goes back to the head of its tenant's queue (the task did not cause that: the
        pool may hand it to a process it has not yet seen die, between the forker's death and the
        processes' ends being read); any other crashed on its task."""
        with self._lock:
            task = process.task
            if task is not None and not process.retired and process.forker is not None \
                    and process.forker.poll() is not None:
                process.task = None
                self._queue.finished(task.tenant)
                self._queue.push_front(task.tenant, task)
                task = None
            if not process.retired:
                self._retire(process)  # a crash on its task: the replacement is the task's tenant's
                logger.error("a grammar compiling process (pid %s) ended unexpectedly; the forker's line on stderr "
                             "says how", process.pid)
                self._failed_starts = 0 if process.ready else self._failed_starts + 1
            if process.charged is not None:  # a replacement that never got ready: the next one is
                self._owed.append(process.charged)
                process.charged = None
            if task is not None:
                self._tasks.pop(task.future, None)
        if self._failed_starts >= _MAX_FAILED_STARTS:
            self._fail_all(RuntimeError("grammar compilation is unavailable: its processes end before they start"))
            with self._lock:
                self._closed = True
        if task is not None:
            _settle(task.future, error=GrammarTooComplex(
                f"the {task.label} is too complex for this worker: its compiler ran out of resources"))

    def _expire(self) -> None:
        """Kill the processes whose compile ran past its deadline; fail their tasks."""
        now = time.monotonic()
        expired: list[_Task] = []
        with self._lock:
            for process in self._processes:
                task = process.task
                if task is not None and task.deadline is not None and task.deadline <= now:
                    self._tasks.pop(task.future, None)
                    self._retire(process)
                    expired.append(task)
        for task in expired:
            _settle(task.future, error=GrammarTooComplex(
                f"compiling the {task.label} took longer than this worker's budget of {self._timeout:g} s; "
                "send a simpler one (fewer nesting levels, smaller bounds)"))

    def _retire(self, process: _Process) -> None:
        """Kill `process` (under the lock). Killed while it compiled a tenant's task, the process
        that replaces it takes that task's place in the tenant's share until it is ready."""
        if process.task is not None:
            self._owed.append(process.task.tenant)
            process.task = None
        process.retired = True
        if process.pid is not None and self._control is not None:
            try:
                self._control.send(("kill", process.pid))
            except OSError:  # the forker is gone, and its processes with it
                pass


def _settle(future: Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    """Set `future` unless it was cancelled meanwhile."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
