"""The order in which xdist hands the suite's files out: longest first (`-p tests.file_order`).

Under `--dist loadfile` a worker runs whole files, taken in collection order as it frees up, and the
run lasts as long as its busiest worker. Collected alphabetically, the heaviest files (the launcher's,
the training and distributed suites) came late and one worker ran the last of them alone for the
run's final minute. Handing the longest files out first (the longest-processing-time rule) leaves
the short ones to fill the gaps at the end.

A file's weight is its measured seconds in tests/file_durations.json (`make test-durations`
rewrites it from a run's JUnit report: `python -m tests.file_order REPORT`); a file not in it (new since) is estimated from its tests'
tiers. Only the order changes, so a stale table costs balance, never a result. Tests keep their
order within a file. Single-process runs keep pytest's order: there is nothing to balance.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("file_durations.json")
# Estimates for a file the table does not know, per test: an e2e test starts processes and waits on
# them; a slow one computes for seconds; the rest are mostly well under a second.
E2E_SECONDS, SLOW_SECONDS, FAST_SECONDS = 5.0, 3.0, 0.1


def measured() -> dict[str, float]:
    """Seconds per file (the path relative to the repository root) from the committed table."""
    try:
        return {str(path): float(seconds) for path, seconds in json.loads(DURATIONS.read_text()).items()}
    except FileNotFoundError:
        return {}


def estimate(items: list[pytest.Item]) -> float:
    return sum(E2E_SECONDS if item.get_closest_marker("e2e") else SLOW_SECONDS if item.get_closest_marker("slow")
               else FAST_SECONDS for item in items)


def longest_first(items: list[pytest.Item], root: Path, table: dict[str, float]) -> list[pytest.Item]:
    by_file: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:  # dicts keep insertion order: each file's tests keep theirs
        by_file[Path(item.path).relative_to(root).as_posix()].append(item)
    weight = {path: table[path] if path in table else estimate(tests) for path, tests in by_file.items()}
    # Ties (and every file in a run with no table) keep the collection's order: sorted() is stable.
    return [item for path in sorted(by_file, key=lambda path: -weight[path]) for item in by_file[path]]


@pytest.hookimpl(trylast=True)  # after tests.tiers has marked e2e, which the estimate reads
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # not an xdist worker: one process, nothing to balance
        return
    items[:] = longest_first(items, config.rootpath, measured())


def file_seconds(report: Path) -> dict[str, float]:
    """Seconds per test file in a JUnit report: the sum of its cases' times (set-up, call, teardown)."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).iter("testcase"):
        # pytest's classname is the module's dotted path, then the class where there is one.
        parts = [part for part in case.get("classname", "").split(".") if not part[:1].isupper()]
        seconds["/".join(parts) + ".py"] += float(case.get("time", 0))
    return dict(seconds)


def main(argv: list[str]) -> int:
    """Rewrite the table from the JUnit report named in ``argv``."""
    if len(argv) != 1:
        print("usage: python -m tests.file_order JUNIT_XML", file=sys.stderr)
        return 2
    table = {path: round(value, 1) for path, value in sorted(file_seconds(Path(argv[0])).items())}
    DURATIONS.write_text(json.dumps(table, indent=0) + "\n")
    print(f"{DURATIONS}: {len(table)} files, {sum(table.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
