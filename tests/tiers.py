"""The suite's two tiers (docs/testing.md, "Tiers and markers"): a pytest plugin (`-p tests.tiers`).

A test that starts a real process (a web process, a serving worker, a Celery worker, a Redis server
of its own, a browser) is `e2e`; one that stays in this process but computes for many seconds (trains
an adapter, runs Triton's interpreter, draws thousands of property examples) is `slow`; `make
test-fast` runs the rest, `make test` all three. Every test that uses one of
E2E_FIXTURES, directly or through another fixture, is marked at collection, so a new test cannot
forget it. A test that starts a process in its own body carries `pytestmark = pytest.mark.e2e`;
one that forgets is named at the end of the run: every process a test's set-up and body start is
counted: subprocess's, multiprocessing's (the process engine, tensor-parallel ranks; it forks and
execs without subprocess) and the zygote's forks (which go over a socket). A fast-tier test whose call
took more than SLOW_SECONDS is named too (a hint, never a failure: the machine's speed varies).

A plugin rather than part of tests/conftest.py so that it is imported once, as `tests.tiers`
(tests/ is not a package: its conftest is imported under another name than a test's import of it).
"""

from __future__ import annotations

import multiprocessing.process
import subprocess
from collections.abc import Iterator

import pytest

from tests import zygote

E2E_FIXTURES = frozenset({
    "_web_processes", "start_web", "web",  # the gateway's and the training suites' web processes
    "_worker_processes", "start_worker", "worker",  # serving workers; the training suites' Celery workers
    "own_redis",  # a Redis server of the test's own (broker outages, the registry's pub/sub)
})
STARTED_UNMARKED = "started a process without the e2e marker"
SLOW_UNMARKED = "ran long without the slow marker"
# A fast-tier test's call past this many seconds is named at the end of the run.
SLOW_SECONDS = 10.0
# Processes started by this test process so far.
starts = [0]
_starts_before = pytest.StashKey[int]()


def _count_process_starts() -> None:
    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    fork = zygote._Zygote.start

    def counted_execute_child(self: subprocess.Popen[bytes], *args: object, **kwargs: object) -> None:
        starts[0] += 1
        execute_child(self, *args, **kwargs)

    def counted_fork(self: zygote._Zygote, *args: object, **kwargs: object) -> zygote.ZygoteProcess:
        starts[0] += 1
        return fork(self, *args, **kwargs)  # type: ignore[arg-type]

    start = multiprocessing.process.BaseProcess.start

    def counted_start(self: multiprocessing.process.BaseProcess) -> None:
        starts[0] += 1
        start(self)

    subprocess.Popen._execute_child = counted_execute_child  # type: ignore[attr-defined]
    multiprocessing.process.BaseProcess.start = counted_start  # type: ignore[method-assign]
    zygote._Zygote.start = counted_fork  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: starts real processes (web process, serving worker, Celery worker, "
                                       "Redis server); `make test-fast` leaves them out (docs/testing.md)")
    config.addinivalue_line("markers", "slow: in-process but seconds of compute (training, Triton's interpreter); "
                                       "`make test-fast` leaves them out (docs/testing.md)")
    _count_process_starts()


def mark(items: list[pytest.Item]) -> None:
    for item in items:
        if E2E_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark(items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_starts_before] = starts[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """The call's report carries how many processes the test's set-up and body started, and how long a
    fast-tier test's call took when past SLOW_SECONDS."""
    outcome = yield
    if call.when == "call" and not item.get_closest_marker("e2e"):
        started = starts[0] - item.stash.get(_starts_before, starts[0])
        if started:
            outcome.get_result().user_properties.append((STARTED_UNMARKED, started))
        elif call.duration > SLOW_SECONDS and not item.get_closest_marker("slow"):
            outcome.get_result().user_properties.append((SLOW_UNMARKED, round(call.duration, 1)))


def _reports_with(terminalreporter: pytest.TerminalReporter, key: str) -> list[tuple[str, object]]:
    return sorted((report.nodeid, dict(report.user_properties)[key])
                  for reports in terminalreporter.stats.values() for report in reports
                  if key in dict(getattr(report, "user_properties", ())))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    long_running = _reports_with(terminalreporter, SLOW_UNMARKED)
    if long_running:
        terminalreporter.write_sep("=", f"fast-tier tests whose call took over {SLOW_SECONDS:.0f} s", yellow=True)
        terminalreporter.write_line("Make them cheaper, or mark them `pytest.mark.slow` if their cost is what they "
                                    "test (docs/testing.md): `make test-fast` should stay under a minute.")
        for nodeid, seconds in long_running:
            terminalreporter.write_line(f"  {seconds} s  {nodeid}")
    unmarked = [nodeid for nodeid, _ in _reports_with(terminalreporter, STARTED_UNMARKED)]
    if unmarked:
        terminalreporter.write_sep("=", "tests that start processes but are not marked e2e", yellow=True)
        terminalreporter.write_line("Mark them `pytest.mark.e2e` (or use a fixture of tests.tiers.E2E_FIXTURES): "
                                    "`make test-fast` runs them otherwise.")
        for nodeid in unmarked:
            terminalreporter.write_line(f"  {nodeid}")
