"""tests/file_order.py hands xdist's workers the longest files first, from a table it writes from a
JUnit report."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.file_order import E2E_SECONDS, FAST_SECONDS, file_seconds, longest_first


@dataclass
class Item:
    """What the ordering reads of a pytest item: its file and its tier markers."""

    path: Path
    name: str
    marks: set[str] = field(default_factory=set)

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self.marks else None


def test_known_files_go_longest_first_and_each_keeps_its_tests_order(tmp_path: Path) -> None:
    a = [Item(tmp_path / "tests/a.py", f"a{i}") for i in range(3)]
    b = [Item(tmp_path / "tests/b.py", "b0")]
    c = [Item(tmp_path / "tests/c.py", f"c{i}") for i in range(2)]
    items = [a[0], a[1], b[0], a[2], c[0], c[1]]  # a file's tests need not be contiguous (pytest-django)
    table = {"tests/a.py": 1.0, "tests/b.py": 30.0, "tests/c.py": 5.0}
    ordered = longest_first(items, tmp_path, table)  # type: ignore[arg-type]  # duck-typed items
    assert [item.name for item in ordered] == ["b0", "c0", "c1", "a0", "a1", "a2"]


def test_a_file_the_table_does_not_know_is_weighed_by_its_tiers(tmp_path: Path) -> None:
    new_e2e = [Item(tmp_path / "tests/new_e2e.py", "n0", {"e2e"})]  # 5 s estimated
    new_fast = [Item(tmp_path / "tests/new_fast.py", f"f{i}") for i in range(10)]  # 1 s estimated
    known = [Item(tmp_path / "tests/known.py", "k0")]
    table = {"tests/known.py": 2.0}
    assert E2E_SECONDS > 2.0 > 10 * FAST_SECONDS
    ordered = longest_first([*new_fast, *known, *new_e2e], tmp_path, table)  # type: ignore[arg-type]
    assert [item.name for item in ordered][:2] == ["n0", "k0"] and len(ordered) == 12


def test_ties_keep_the_collection_order(tmp_path: Path) -> None:
    items = [Item(tmp_path / f"tests/t{i}.py", str(i)) for i in (3, 1, 2)]
    ordered = longest_first(items, tmp_path, {})  # type: ignore[arg-type]
    assert [item.name for item in ordered] == ["3", "1", "2"]


def test_the_table_sums_each_files_cases_and_classes_fold_into_their_file(tmp_path: Path) -> None:
    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.engine.test_x" name="test_a" time="1.5"/>'
        '<testcase classname="tests.engine.test_x.TestGroup" name="test_b" time="2.0"/>'
        '<testcase classname="tests.test_y" name="test_c[param]" time="0.25"/>'
        "</testsuite></testsuites>"
    )
    assert file_seconds(report) == pytest.approx({"tests/engine/test_x.py": 3.5, "tests/test_y.py": 0.25})
