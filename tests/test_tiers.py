"""The suite's tiers (docs/testing.md, "Tiers and markers"): a test that uses a process-starting
fixture is marked e2e at collection, and the processes a test starts are counted, so one that
starts a process unmarked is named at the end of the run; so is a fast-tier test that ran long
without the slow marker."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests import tiers


class _Item:
    def __init__(self, fixturenames: list[str], markers: tuple[str, ...] = ()) -> None:
        self.fixturenames = fixturenames
        self.markers: list[str] = list(markers)
        self.stash: dict[object, int] = {}

    def add_marker(self, marker: pytest.MarkDecorator) -> None:
        self.markers.append(marker.name)

    def get_closest_marker(self, name: str) -> str | None:
        return name if name in self.markers else None


def test_a_test_using_a_process_fixture_directly_or_not_is_marked_e2e() -> None:
    # pytest lists a fixture's own fixtures in the test's fixturenames: `registry` -> `start_worker`.
    through_another, direct, in_process = _Item(["registry", "start_worker"]), _Item(["web"]), _Item(["db", "client"])
    tiers.mark([through_another, direct, in_process])  # type: ignore[list-item]
    assert "e2e" in through_another.markers and "e2e" in direct.markers
    assert "e2e" not in in_process.markers


def test_the_e2e_and_slow_markers_are_registered(pytestconfig: pytest.Config) -> None:
    assert any(line.startswith("e2e:") for line in pytestconfig.getini("markers"))
    assert any(line.startswith("slow:") for line in pytestconfig.getini("markers"))


def _call_report(item: _Item, seconds: float) -> dict[str, object]:
    """The user properties tiers' report hook gives a call of `seconds` that started no process."""
    hook = tiers.pytest_runtest_makereport(item, SimpleNamespace(when="call", duration=seconds))  # type: ignore[arg-type]
    next(hook)
    report = SimpleNamespace(user_properties=[])
    with pytest.raises(StopIteration):
        hook.send(SimpleNamespace(get_result=lambda: report))
    return dict(report.user_properties)


def test_a_long_fast_tier_call_is_named_unless_marked_slow_or_e2e() -> None:
    long = tiers.SLOW_SECONDS + 1
    assert _call_report(_Item([]), long) == {tiers.SLOW_UNMARKED: long}
    assert _call_report(_Item([]), tiers.SLOW_SECONDS - 1) == {}
    assert _call_report(_Item([], markers=("slow",)), long) == {}
    assert _call_report(_Item([], markers=("e2e",)), long) == {}


@pytest.mark.e2e
def test_a_process_the_test_starts_is_counted() -> None:
    before = tiers.starts[0]
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert tiers.starts[0] == before + 1
    child = multiprocessing.get_context("spawn").Process(target=int)
    child.start()
    child.join()
    assert tiers.starts[0] == before + 2
