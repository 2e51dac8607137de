"""The suite's Python processes forked from an interpreter that has already imported the heavy
libraries (a zygote, as Android starts its apps), instead of started cold.

Why: a run starts about a hundred serving workers, web processes and Celery workers, and each
spent most of its 3-5 s of start-up CPU importing torch, transformers and peft (and reading
transformers' 1,677 model files for its lazy import structure) before running a line of ours
(docs/testing.md, "Where the time goes"). A fork of a process that did it once costs a few
milliseconds, and the pages stay shared.

`popen(argv, ...)` takes what `subprocess.Popen` takes for `[sys.executable, "-m", module, ...]`
and returns a handle with the part of Popen the suite uses (pid, returncode, poll, wait,
send_signal, terminate, kill). The child runs the module as `python -m` would: as `__main__`,
with the argv, working directory, environment, standard streams and `pass_fds` (at the same
numbers) asked for, in a session of its own if asked, with the default signal handlers, and ends
as a cold interpreter ends (non-daemon threads joined, atexit handlers run, exit status or
signal). Anything else falls back to a real Popen: another program or `-c`, a pipe or /dev/null
asked for. `LORAPLEX_TEST_ZYGOTE=0` turns it off.

A zygote is started by the test process (each xdist worker) at the first `popen` of each set of
values it is asked for in the variables read at import time (HF_*, TRITON_*, OMP_*, PYTHONPATH,
...: the preloaded libraries read them when the zygote imported them), with that environment, and
ends with the test process: it leaves when its standard input (a pipe from the test process) closes. The
process guard (tests.process_guard) counts it as the interpreter's helper, as it does
multiprocessing's fork server, and its children as the test's.
"""

from __future__ import annotations

import array
import fcntl
import functools
import gc
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
ENABLED_VAR = "LORAPLEX_TEST_ZYGOTE"
# The libraries every started process imports first; what follows them is the project's own code,
# which reads its settings when imported and so is imported in each child.
# The second line: the third-party modules the web process, the serving worker and Celery import
# next (0.5-1 s of CPU a start, most of what a forked child imported before its first line of
# ours), none of which reads Django's settings or an environment variable outside
# _IMPORT_TIME_PREFIXES / _IMPORT_TIME_NAMES when imported (Django's modules here import with an
# unimportable DJANGO_SETTINGS_MODULE). Not DRF's views (they read the settings) nor prometheus_client
# (PROMETHEUS_MULTIPROC_DIR, which a test sets per web process).
PRELOAD = ("torch", "transformers", "peft", "safetensors", "numpy", "httpx", "uvicorn", "celery", "kombu",
           "redis", "django", "boto3",
           "pydantic_settings", "fastapi", "psycopg", "requests", "jsonschema", "sqlparse", "markdown",
           "celery.bin.celery", "django.db.models", "django.db.backends.postgresql.base", "django.http",
           "django.urls", "django.forms", "django.template", "django.core.handlers.asgi")
# Variables read when the preloaded libraries are imported (or by the interpreter at start): a
# child asking for other values than the zygote's is started cold.
_IMPORT_TIME_PREFIXES = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "TRITON", "CUDA", "OMP_",
                         "MKL_", "OPENBLAS", "TOKENIZERS", "PYTHON", "LD_", "SAFETENSORS", "PEFT", "PSYCOPG")
# Celery's modules read these when imported.
_IMPORT_TIME_NAMES = frozenset({"C_FAKEFORK", "C_BENCH", "CELERY_BENCH", "C_REMDEBUG", "MP_LOG", "USE_FAST_LOCALS",
                                "TIMER_DEBUG", "FORKED_BY_MULTIPROCESSING"})
# Applied in the child, so they need not match.
_APPLIED_IN_CHILD = {"PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE"}
_MAX_MESSAGE = 1 << 20
# The most descriptors a child may be handed besides its standard streams (`pass_fds`).
_MAX_PASS_FDS = 8


def _import_time_env(env: Mapping[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items()
            if (key.startswith(_IMPORT_TIME_PREFIXES) or key in _IMPORT_TIME_NAMES) and key not in _APPLIED_IN_CHILD
            and not (key == "PYTHONPATH" and not _provides_preloaded(value))}


@functools.lru_cache(maxsize=None)
def _provides_preloaded(pythonpath: str) -> bool:
    """Whether a PYTHONPATH has an entry holding one of the preloaded packages: only then does it
    change what the zygote imports. One that does not (the repository's root, which the distributed
    ranks' drivers put first) is applied in the child, as the interpreter applies it at start
    (`_run_child`), so the ranks share their test process's zygote instead of starting one more."""
    from importlib.machinery import PathFinder

    tops = {module.split(".")[0] for module in PRELOAD}
    entries = [entry for entry in pythonpath.split(os.pathsep) if entry]
    return any(PathFinder.find_spec(top, [entry]) is not None for entry in entries for top in tops)


# ---- the test process's side -------------------------------------------------------------------


class ZygoteProcess:
    """A child forked by the zygote: its exit status comes back over its own connection, since the
    test process is not its parent and cannot wait for it."""

    def __init__(self, connection: socket.socket, pid: int, args: Sequence[str]) -> None:
        self._connection = connection
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._receive(timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._receive(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a pid that may since have been reused
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _receive(self, timeout: float | None) -> None:
        self._connection.settimeout(timeout)
        try:
            message = self._connection.recv(_MAX_MESSAGE)
        except (BlockingIOError, TimeoutError):
            return
        if not message:
            raise RuntimeError(f"the zygote ended before child {self.pid} did")
        self.returncode = json.loads(message)["returncode"]
        self._connection.close()


class _Zygote:
    def __init__(self, env: dict[str, str], name: str | None = None) -> None:
        """A zygote started with `env`; or, with `name`, the running one of that name (a zygote's child
        asking its own parent, `_zygote_for`): no process of ours to watch then."""
        # An abstract socket (the leading NUL): nothing on disk to clean up.
        self.name = name or f"loraplex-test-zygote-{os.getpid()}-{time.monotonic_ns()}"
        self.address = "\0" + self.name
        self.process: subprocess.Popen[bytes] | None = None
        if name is None:
            self.process = subprocess.Popen([sys.executable, "-m", "tests.zygote", self.name], cwd=ROOT,
                                            stdin=subprocess.PIPE, env=env)

    def start(self, args: Sequence[str], *, cwd: str, env: Mapping[str, str], fds: Sequence[int],
              pass_fds: Sequence[int], start_new_session: bool) -> ZygoteProcess:
        deadline = time.monotonic() + 120
        while True:
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                connection.connect(self.address)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                connection.close()
                if self.process is None or self.process.poll() is not None or time.monotonic() > deadline:
                    ended = "gone" if self.process is None else f"exit {self.process.returncode}"
                    raise RuntimeError(f"the zygote did not start ({ended})") from None
                time.sleep(0.05)
        request = {"module": args[2], "argv": list(args[3:]), "cwd": cwd, "env": dict(env),
                   "start_new_session": start_new_session, "pass_fds": list(pass_fds)}
        socket.send_fds(connection, [json.dumps(request).encode()], [*fds, *pass_fds])
        pid = json.loads(connection.recv(_MAX_MESSAGE))["pid"]
        return ZygoteProcess(connection, pid, args)


# One zygote per set of import-time values asked for (the training suites' processes run with
# OMP_NUM_THREADS=1, which OpenMP reads when torch loads it): a handful per test process.
_zygotes: dict[frozenset[tuple[str, str]], _Zygote] = {}
_zygotes_lock = threading.Lock()


def zygote_pids() -> set[int]:
    """This process's live zygotes (tests.process_guard does not count them as left over)."""
    return {zygote.process.pid for zygote in list(_zygotes.values())
            if zygote.process is not None and zygote.process.poll() is None}


# In a zygote's child: the zygote's own (its name and import-time values, set by `serve` before it
# forks), which the child's `popen` asks for what it may fork (`_zygote_for`).
_parent: tuple[_Zygote, frozenset[tuple[str, str]]] | None = None


def _zygote_for(env: Mapping[str, str]) -> _Zygote | None:
    """The zygote of `env`'s import-time values, started at the first call for them. In a zygote's
    child, its parent when the values are the parent's, else None (started cold: a child never starts
    a zygote of its own, seconds of CPU for the one process it would fork)."""
    key = frozenset(_import_time_env(env).items())
    if _parent is not None:
        return _parent[0] if key == _parent[1] else None
    with _zygotes_lock:
        zygote = _zygotes.get(key)
        if zygote is None or zygote.process.poll() is not None:
            # A PYTHONPATH applied in the child is left out of the zygote's own environment.
            own = {k: v for k, v in env.items() if k != "PYTHONPATH" or ("PYTHONPATH", v) in key}
            zygote = _zygotes[key] = _Zygote(own)
    return zygote


def zygote_pid(env: Mapping[str, str]) -> int:
    """The pid of the zygote that forks a child asked for with `env`, the child's parent (a test whose
    child checks its parent's pid, as a training rank does, hands it this one)."""
    zygote = _zygote_for(env)
    assert zygote is not None and zygote.process is not None, "only a test process starts zygotes"
    return zygote.process.pid


def _stream_fd(stream: int | IO[Any] | None, own: int) -> int | None:
    """The descriptor a Popen-style stream argument names; None for a pipe (not supported here)."""
    if stream is None:
        return own
    if stream == subprocess.PIPE:
        return None
    if isinstance(stream, int):
        return stream
    return stream.fileno()


def popen(args: Sequence[str], *, cwd: str | Path | None = None, env: Mapping[str, str] | None = None,
          stdin: int | IO[Any] | None = None, stdout: int | IO[Any] | None = None,
          stderr: int | IO[Any] | None = None, start_new_session: bool = False,
          pass_fds: Sequence[int] = ()) -> subprocess.Popen | ZygoteProcess:
    """`subprocess.Popen(args, ...)`, forked from the zygote when it can be (the module docstring)."""
    env = dict(os.environ if env is None else env)
    cold = dict(cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr, start_new_session=start_new_session,
                pass_fds=tuple(pass_fds))
    fds = [_stream_fd(stdin, 0), _stream_fd(stdout, 1), _stream_fd(stderr, 2)]
    if stderr == subprocess.STDOUT:
        fds[2] = fds[1]
    if stdin == subprocess.DEVNULL or stdout == subprocess.DEVNULL or stderr == subprocess.DEVNULL:
        return subprocess.Popen(args, **cold)
    if (os.environ.get(ENABLED_VAR) == "0" or len(args) < 3 or args[0] != sys.executable or args[1] != "-m"
            or None in fds or len(pass_fds) > _MAX_PASS_FDS or any(fd <= 2 for fd in pass_fds)):
        return subprocess.Popen(args, **cold)
    zygote = _zygote_for(env)
    if zygote is None:
        return subprocess.Popen(args, **cold)
    return zygote.start(args, cwd=str(cwd or os.getcwd()), env=env, fds=[fd for fd in fds if fd is not None],
                        pass_fds=pass_fds, start_new_session=start_new_session)


def devnull_popen(args: Sequence[str], *, stdin: Any = None, **options: Any) -> subprocess.Popen | ZygoteProcess:
    """`popen` for a caller that asks for `stdin=DEVNULL` (the grammar pool, for its forker): /dev/null
    opened here and handed over as a descriptor, which the zygote takes (it starts cold what asks for
    DEVNULL)."""
    if stdin != subprocess.DEVNULL:
        return popen(args, stdin=stdin, **options)
    with open(os.devnull, "rb") as devnull:  # the child has its own copy once started
        return popen(args, stdin=devnull.fileno(), **options)


def grammar_forker_forked(grammar_pool: Any) -> None:
    """The grammar pool's forker (`python -m serving.engine.grammar_worker FD`, 2.2 s of CPU cold, most
    of it importing xgrammar, torch and transformers) forked from the zygote, for the pools of
    `grammar_pool`'s module (serving.engine.grammar_pool, passed in: this module imports none of the
    project's). Its name `subprocess` becomes a namespace of its own, never the library's attribute,
    which every other caller in the process shares. The forker's own code runs as when cold; its
    parent is the zygote, and it leaves when its pool's socket closes, as it does anyway."""
    grammar_pool.subprocess = SimpleNamespace(Popen=devnull_popen, DEVNULL=subprocess.DEVNULL,
                                              TimeoutExpired=subprocess.TimeoutExpired)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `then(module)` right after module `name` is first imported (and leaves `sys.meta_path`)."""

    zygote_hook = True  # a child that must run without it drops it by this (tests/engine/spawn_child.py)

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            self.then(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's loader alone
        return spec


# ---- the zygote's side ---------------------------------------------------------------------------


def _run_child(request: dict[str, Any]) -> None:
    """In the forked child: become `python -m module argv...` as asked, run it, and exit as a cold
    interpreter would. Never returns."""
    code: int = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if request["start_new_session"]:
            os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.dont_write_bytecode = bool(request["env"].get("PYTHONDONTWRITEBYTECODE"))
        if request["env"].get("PYTHONUNBUFFERED"):
            for stream in (sys.stdout, sys.stderr):
                stream.reconfigure(write_through=True)
        sys.path[0] = request["cwd"]
        if not _OWN_PYTHONPATH:
            # A PYTHONPATH the zygote was not keyed on (`_provides_preloaded`): its entries go where
            # the interpreter puts them at start, right after the first entry.
            sys.path[1:1] = [entry for entry in request["env"].get("PYTHONPATH", "").split(os.pathsep) if entry]
        sys.argv = [request["module"], *request["argv"]]
        # A serving worker's grammar pool forks its forker from this zygote, as an in-process engine's
        # does from its test process's (tests/engine/conftest.py): 0.2 s of CPU to its first compiling
        # process against 1.7 s cold, a dozen a run. Patched when the pool's module is imported, so a
        # child that never imports it (a web process, a Celery worker) is untouched.
        sys.meta_path.insert(0, _AfterImport("serving.engine.grammar_pool", grammar_forker_forked))
        import runpy

        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            code = _exit_code(exit_.code)
        except KeyboardInterrupt:
            _finish()
            # As a cold interpreter: an unhandled Ctrl-C ends the process by SIGINT.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        _finish()
    finally:
        os._exit(code)


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def _finish() -> None:
    """What the interpreter does on its way out: join non-daemon threads, run atexit, flush."""
    import atexit

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _fork(connection: socket.socket, own: list[int]) -> int | None:
    """Read one request from `connection` and fork its child; its pid, or None for a bad request."""
    message, fds, _, _ = socket.recv_fds(connection, _MAX_MESSAGE, 3 + _MAX_PASS_FDS)
    request = json.loads(message) if message else None
    if request is None or len(fds) != 3 + len(request["pass_fds"]):
        for fd in fds:
            os.close(fd)
        return None
    pid = os.fork()
    if pid == 0:
        for index, fd in enumerate(fds[:3]):
            os.dup2(fd, index)
        # Above every number asked for, so placing one never overwrites another still to be placed.
        floor = max([2, *request["pass_fds"]]) + 1
        passed = [fcntl.fcntl(fd, fcntl.F_DUPFD, floor) for fd in fds[3:]]
        for fd in {*fds, *own, connection.fileno()}:
            if fd > 2:
                os.close(fd)
        for fd, number in zip(passed, request["pass_fds"]):
            os.dup2(fd, number)  # inheritable, as Popen's pass_fds leaves them
            os.close(fd)
        _run_child(request)
    for fd in fds:
        os.close(fd)
    connection.send(json.dumps({"pid": pid}).encode())
    return pid


# The zygote's own PYTHONPATH (set where the zygote was keyed on one, `_zygote_for`).
_OWN_PYTHONPATH = os.environ.get("PYTHONPATH", "")


def serve(name: str) -> None:
    """The zygote: preload, then fork a child per connection until standard input closes."""
    global _parent
    # The values it was started for, read before the imports (torch sets TORCHINDUCTOR_CACHE_DIR).
    _parent = (_Zygote({}, name), frozenset(_import_time_env(os.environ).items()))
    for module in PRELOAD:
        importlib.import_module(module)
    # Touched here, so transformers' lazy import structure is built once (0.9 s a process).
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401
    # What the children inherit leaves the collector's generations (as serving's own processes and the
    # test process do, tests/startup_gc.py): a child's full collections no longer walk the preloaded
    # libraries' objects, nor write to their pages. A Celery worker forked from here spent 1.2-1.4 s of
    # CPU to `ready.`, 0.3 s of it in the gc.collect() Celery runs before forking its pool process;
    # 0.4-0.5 s since.
    gc.collect()
    gc.freeze()

    wake_read, wake_write = socket.socketpair()
    wake_read.setblocking(False)
    wake_write.setblocking(False)
    signal.set_wakeup_fd(wake_write.fileno())
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind("\0" + name)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "listen")
    selector.register(wake_read, selectors.EVENT_READ, "child")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")
    children: dict[int, socket.socket] = {}
    own = [listener.fileno(), wake_read.fileno(), wake_write.fileno(), selector.fileno()]
    while True:
        for key, _ in selector.select():
            if key.data == "parent" and not os.read(sys.stdin.fileno(), 4096):
                return  # the test process ended; the process guard deals with any child still alive
            if key.data == "listen":
                connection, _ = listener.accept()
                pid = _fork(connection, [*own, *(c.fileno() for c in children.values())])
                if pid is None:
                    connection.close()
                else:
                    children[pid] = connection
            if key.data == "child":
                try:
                    while wake_read.recv(4096):
                        pass
                except BlockingIOError:
                    pass
                _reap(children)


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            try:
                connection.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
            except OSError:
                pass  # the test process dropped the handle
            connection.close()


if __name__ == "__main__":
    serve(sys.argv[1])
