"""Under `--dist loadfile`, the test files go out longest first, by a committed table of how long
each took (tests/file_durations.json), so the slowest ones start early (docs/testing.md).

pytest-xdist's own loadfile order is by number of tests, which sends the slow files with few tests
(a launcher brought up and killed, a worker SIGKILLed mid-stream: one or two tests of 30-60 s each)
out last, where one worker runs them while the others idle. Handing out the longest first (LPT, as
a greedy makespan scheduler does) leaves the short files for the end, where they fill the gaps.

A file the table does not know yet is estimated at the table's mean seconds per test times its
number of tests. The order of the tests within a file is the collection's (pytest-django's: plain
tests before transactional ones), as xdist's loadfile keeps it.

`--file-durations-write PATH` writes the table from the run it ends (setup, call and teardown of
each test, summed per file); `make test-durations` refreshes the committed one. An early plugin
(`-p tests.xdist_schedule` in pyproject's addopts), as the hook must be known when xdist starts.
"""

from __future__ import annotations

import json
from collections import OrderedDict, defaultdict
from pathlib import Path

import pytest

TABLE = Path(__file__).with_name("file_durations.json")
READ_OPTION = "--file-durations"
WRITE_OPTION = "--file-durations-write"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(READ_OPTION, metavar="PATH", default=str(TABLE),
                     help="the table of test file -> seconds that orders --dist loadfile (default: %(default)s)")
    parser.addoption(WRITE_OPTION, metavar="PATH", default=None,
                     help="write each test file's duration (seconds, setup+call+teardown) of this run as JSON "
                          "(tests/xdist_schedule.py orders --dist loadfile by it)")


def durations_read(path: Path) -> dict[str, float]:
    """The table: test file (as in node ids) → seconds. Empty when there is none."""
    if not path.exists():
        return {}
    table = json.loads(path.read_text())
    if not isinstance(table, dict) or not all(isinstance(v, (int, float)) for v in table.values()):
        raise ValueError(f"{path}: expected a JSON object of test file -> seconds")
    return {str(name): float(seconds) for name, seconds in table.items()}


def longest_first(files: dict[str, int], table: dict[str, float]) -> list[str]:
    """`files` (file → its number of tests) in the order to hand them out: the table's duration,
    or for a file it lacks, the table's mean seconds per test times its tests; longest first.
    Ties keep the collection's order (sorted is stable)."""
    known = [name for name in files if name in table]
    tests_known = sum(files[name] for name in known)
    per_test = sum(table[name] for name in known) / tests_known if tests_known else 1.0

    def estimate(name: str) -> float:
        return table[name] if name in table else per_test * files[name]

    return sorted(files, key=estimate, reverse=True)


def _scheduler_class() -> type:
    from xdist.scheduler import LoadFileScheduling

    class LongestFileFirstScheduling(LoadFileScheduling):
        """xdist's loadfile, its work queue reordered once built (before the first file goes out)."""

        def _assign_work_unit(self, node: object) -> None:
            if not getattr(self, "_ordered", False):
                self._ordered = True
                table = durations_read(Path(self.config.getoption(READ_OPTION)))
                counts = {scope: len(tests) for scope, tests in self.workqueue.items()}
                units = dict(self.workqueue)
                self.workqueue = OrderedDict((scope, units[scope]) for scope in longest_first(counts, table))
            super()._assign_work_unit(node)

    return LongestFileFirstScheduling


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, on the controller
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own for every other mode
    return _scheduler_class()(config, log)


class _Recorder:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid.split("::", 1)[0]] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if getattr(session.config, "workerinput", None) is not None:
            return  # an xdist worker: the controller, which sees every report, writes the table
        table = {name: round(seconds, 1) for name, seconds in sorted(self.seconds.items())}
        self.path.write_text(json.dumps(table, indent=1) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption(WRITE_OPTION)
    if path:
        config.pluginmanager.register(_Recorder(Path(path)), "file-durations-recorder")
