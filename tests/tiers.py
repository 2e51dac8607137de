"""The suite's two tiers (docs/testing.md, "Tiers and markers"): a pytest plugin (`-p tests.tiers`).

A test that starts a real process (a web process, a serving worker, a Celery worker, a Redis server
of its own, a browser) is `e2e`; `make test-fast` runs the rest. Every test that uses one of
E2E_FIXTURES, directly or through another fixture, is marked at collection, so a new test cannot
forget it. A test that starts a process in its own body carries `pytestmark = pytest.mark.e2e`;
one that forgets is named at the end of the run: every process a test's set-up and body start is
counted: subprocess's, multiprocessing's (the process engine, tensor-parallel ranks; it forks and
execs without subprocess) and the zygote's forks (which go over a socket).

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
    """The call's report carries how many processes the test's set-up and body started."""
    outcome = yield
    if call.when == "call" and not item.get_closest_marker("e2e"):
        started = starts[0] - item.stash.get(_starts_before, starts[0])
        if started:
            outcome.get_result().user_properties.append((STARTED_UNMARKED, started))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    unmarked = sorted(report.nodeid for reports in terminalreporter.stats.values() for report in reports
                      if STARTED_UNMARKED in dict(getattr(report, "user_properties", ())))
    if unmarked:
        terminalreporter.write_sep("=", "tests that start processes but are not marked e2e", yellow=True)
        terminalreporter.write_line("Mark them `pytest.mark.e2e` (or use a fixture of tests.tiers.E2E_FIXTURES): "
                                    "`make test-fast` runs them otherwise.")
        for nodeid in unmarked:
            terminalreporter.write_line(f"  {nodeid}")
