"""The suite's processes forked from the zygote (tests/zygote.py) behave as ones started cold."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import zygote

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _zygote_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are the zygote's, even in a run that turned it off for the others."""
    monkeypatch.delenv(zygote.ENABLED_VAR, raising=False)


def write_module(directory: Path, name: str, source: str) -> None:
    (directory / f"{name}.py").write_text(source)


def start(directory: Path, name: str, *argv: str, env: dict[str, str] | None = None, log_name: str = "",
          **kwargs: object) -> tuple[subprocess.Popen | zygote.ZygoteProcess, Path]:
    log = directory / f"{log_name or name}.log"
    with log.open("wb") as handle:
        process = zygote.popen([sys.executable, "-m", name, *argv], cwd=directory,
                               env={**os.environ, **(env or {})}, stdout=handle, stderr=subprocess.STDOUT, **kwargs)
    return process, log


def test_a_module_runs_as_main_with_its_argv_cwd_and_environment(tmp_path: Path) -> None:
    write_module(tmp_path, "report", (
        "import json, os, sys\n"
        "print(json.dumps({'name': __name__, 'argv': sys.argv[1:], 'cwd': os.getcwd(),\n"
        "                  'var': os.environ.get('ZYGOTE_TEST_VAR'), 'pid': os.getpid()}))\n"))
    process, log = start(tmp_path, "report", "--flag", "value", env={"ZYGOTE_TEST_VAR": "seen"})

    assert isinstance(process, zygote.ZygoteProcess)
    assert process.wait(60) == 0
    report = json.loads(log.read_text())
    assert report == {"name": "__main__", "argv": ["--flag", "value"], "cwd": str(tmp_path), "var": "seen",
                      "pid": process.pid}


def test_exit_statuses_are_those_of_a_cold_interpreter(tmp_path: Path) -> None:
    write_module(tmp_path, "exits", (
        "import sys\n"
        "kind = sys.argv[1]\n"
        "if kind == 'code': sys.exit(3)\n"
        "if kind == 'text': sys.exit('stopped: bad input')\n"
        "if kind == 'raise': raise RuntimeError('boom')\n"
        "if kind == 'interrupt': raise KeyboardInterrupt\n"))
    expected = {"code": (3, ""), "text": (1, "stopped: bad input"), "raise": (1, "RuntimeError: boom"),
                "interrupt": (-signal.SIGINT, ""), "none": (0, "")}
    for kind, (status, printed) in expected.items():
        process, log = start(tmp_path, "exits", kind)
        assert process.wait(60) == status, (kind, log.read_text())
        assert printed in log.read_text()


def test_threads_are_joined_and_atexit_runs_before_the_exit(tmp_path: Path) -> None:
    write_module(tmp_path, "ending", (
        "import atexit, threading, time\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "def late():\n"
        "    time.sleep(0.3)\n"
        "    print('thread finished', flush=True)\n"
        "threading.Thread(target=late).start()\n"))
    process, log = start(tmp_path, "ending")

    assert process.wait(60) == 0
    assert log.read_text().splitlines() == ["thread finished", "atexit ran"]


def test_pass_fds_reach_the_child_at_their_numbers_and_no_other_descriptor_does(tmp_path: Path) -> None:
    """As Popen's pass_fds (the grammar pool hands its forker a socket this way): each descriptor at
    its own number, inheritable; the zygote's own listener and connections are not the child's."""
    write_module(tmp_path, "descriptors", (
        "import json, os, sys\n"
        "fds = [int(fd) for fd in sys.argv[1:]]\n"
        "for fd in fds:\n    os.write(fd, str(fd).encode())\n"
        "print(json.dumps({'open': sorted(int(fd) for fd in os.listdir('/proc/self/fd')),\n"
        "                  'inheritable': [os.get_inheritable(fd) for fd in fds]}))\n"))
    pipes = [os.pipe() for _ in range(3)]
    # Numbers out of order and far apart, so one placed must not overwrite another still to be placed.
    # The far one is a free number (F_DUPFD: the lowest free at or above its floor): a dup2 onto a fixed
    # number would close whatever the test process holds there, a pipe end above included.
    far = fcntl.fcntl(pipes[1][1], fcntl.F_DUPFD, max(end for pipe in pipes for end in pipe) + 20)
    wanted = [pipes[2][1], pipes[0][1], far]
    try:
        process, log = start(tmp_path, "descriptors", *map(str, wanted), pass_fds=wanted)
        assert isinstance(process, zygote.ZygoteProcess)
        assert process.wait(60) == 0, log.read_text()
        written = [os.read(read, 16) for read, _ in pipes]
    finally:
        for fd in {*wanted, *(end for pipe in pipes for end in pipe)}:
            os.close(fd)
    assert written == [str(pipes[0][1]).encode(), str(far).encode(), str(pipes[2][1]).encode()]
    report = json.loads(log.read_text())
    assert report["inheritable"] == [True, True, True]
    # Its standard streams, what it was handed, and the listing's own descriptor (/proc/self/fd read).
    assert set(wanted) | {0, 1, 2} <= set(report["open"]) and len(report["open"]) == len(wanted) + 4


def test_signals_and_sessions_work_as_with_popen(tmp_path: Path) -> None:
    write_module(tmp_path, "waits", "import os, time\nprint(os.getpgid(0), os.getsid(0), flush=True)\ntime.sleep(120)\n")
    process, log = start(tmp_path, "waits", start_new_session=True)
    deadline = time.monotonic() + 60
    while not log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)

    assert log.read_text().split() == [str(process.pid), str(process.pid)]
    assert process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(0.1)
    os.killpg(process.pid, signal.SIGTERM)  # as the training suites stop a Celery worker's group
    assert process.wait(60) == -signal.SIGTERM
    process.kill()  # a no-op once it has ended, as with Popen

    write_module(tmp_path, "interrupted", "import time\ntry:\n    time.sleep(120)\nexcept KeyboardInterrupt:\n"
                                          "    print('interrupted', flush=True)\n    raise SystemExit(4)\n")
    process, log = start(tmp_path, "interrupted")
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)  # the default handler: KeyboardInterrupt, as in a cold interpreter
    assert process.wait(60) == 4
    assert log.read_text().strip() == "interrupted"


def test_import_time_variables_get_a_zygote_of_their_own(tmp_path: Path) -> None:
    write_module(tmp_path, "threads", "import torch\nprint(torch.get_num_threads())\n")
    one, one_log = start(tmp_path, "threads", env={"OMP_NUM_THREADS": "1"}, log_name="one")
    two, two_log = start(tmp_path, "threads", env={"OMP_NUM_THREADS": "2"}, log_name="two")

    assert isinstance(one, zygote.ZygoteProcess) and isinstance(two, zygote.ZygoteProcess)
    assert (one.wait(60), two.wait(60)) == (0, 0)
    assert (one_log.read_text().strip(), two_log.read_text().strip()) == ("1", "2")
    assert len(zygote.zygote_pids()) >= 2


def test_a_pythonpath_without_preloaded_packages_shares_the_zygote_and_comes_first_on_sys_path(tmp_path: Path) -> None:
    extra = tmp_path / "extra"
    extra.mkdir()
    write_module(extra, "helper_on_the_path", "VALUE = 'found'\n")
    write_module(tmp_path, "paths", (
        "import json, os, sys\n"
        "try:\n    import helper_on_the_path\n    value = helper_on_the_path.VALUE\nexcept ImportError:\n    value = None\n"
        "print(json.dumps({'parent': os.getppid(), 'second': sys.path[1], 'value': value,\n"
        "                  'env': os.environ.get('PYTHONPATH')}))\n"))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    plain, plain_log = start(tmp_path, "paths", log_name="plain")
    pathed, pathed_log = start(tmp_path, "paths", env={"PYTHONPATH": str(extra)}, log_name="pathed")

    assert isinstance(plain, zygote.ZygoteProcess) and isinstance(pathed, zygote.ZygoteProcess)
    assert (plain.wait(60), pathed.wait(60)) == (0, 0)
    plain_report, pathed_report = json.loads(plain_log.read_text()), json.loads(pathed_log.read_text())
    assert plain_report["parent"] == pathed_report["parent"]  # one zygote forked both
    # As a cold interpreter: the entries right after the first, and in the environment.
    assert pathed_report["second"] == str(extra) and pathed_report["value"] == "found"
    assert pathed_report["env"] == str(extra)
    if "PYTHONPATH" not in os.environ:
        assert plain_report["value"] is None and plain_report["env"] is None and env == dict(os.environ)


def test_what_it_cannot_fork_is_started_cold(tmp_path: Path) -> None:
    piped = zygote.popen([sys.executable, "-m", "json.tool"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert isinstance(piped, subprocess.Popen)
    assert piped.communicate(b'{"a": 1}', timeout=60)[0].split() == [b"{", b'"a":', b"1", b"}"]

    inline = zygote.popen([sys.executable, "-c", "pass"], stdout=subprocess.DEVNULL)
    assert isinstance(inline, subprocess.Popen)
    assert inline.wait(60) == 0


def test_a_childs_grammar_forker_comes_from_its_own_zygote_when_the_import_time_values_match(tmp_path: Path) -> None:
    """A serving worker forked from the zygote has its grammar pool's forker forked from the same zygote
    (its parent then), with /dev/null for stdin, its descriptor passed and its exit status waited for
    as with Popen; asked for other import-time values, the forker starts cold, the worker's child."""
    write_module(tmp_path, "grandchild", (
        "import json, os, sys\n"
        "os.write(int(sys.argv[1]), json.dumps({'parent': os.getppid(),\n"
        "                                       'stdin': os.readlink('/proc/self/fd/0')}).encode())\n"
        "sys.exit(5)\n"))
    write_module(tmp_path, "pool_user", (
        "import json, os, subprocess, sys\n"
        "from serving.engine import grammar_pool\n"
        "def run(env):\n"
        "    read, write = os.pipe()\n"
        "    process = grammar_pool.subprocess.Popen([sys.executable, '-m', 'grandchild', str(write)],\n"
        "                                            pass_fds=(write,), env=env, stdin=subprocess.DEVNULL)\n"
        "    os.close(write)\n"
        "    code = process.wait(60)\n"
        "    return code, json.loads(os.read(read, 4096))\n"
        "same = run(dict(os.environ))\n"
        "other = run({**os.environ, 'OMP_NUM_THREADS': str(int(os.environ.get('OMP_NUM_THREADS', '1')) + 2)})\n"
        "print(json.dumps({'me': os.getpid(), 'parent': os.getppid(), 'same': same, 'other': other}))\n"))
    process, log = start(tmp_path, "pool_user")

    assert isinstance(process, zygote.ZygoteProcess)
    assert process.wait(120) == 0, log.read_text()
    report = json.loads(log.read_text().splitlines()[-1])
    assert report["same"] == [5, {"parent": report["parent"], "stdin": os.devnull}]
    assert report["other"] == [5, {"parent": report["me"], "stdin": os.devnull}]
