"""tests/xdist_schedule.py: `--dist loadfile` hands files out longest first by the durations table,
files it lacks estimated by their number of tests; the table is written from a real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.xdist_schedule import TABLE, durations_read, longest_first

ROOT = Path(__file__).resolve().parents[1]


def test_longest_first_by_the_table_and_unknown_files_by_their_tests() -> None:
    table = {"slow_few.py": 60.0, "fast_many.py": 10.0, "medium.py": 30.0}  # 100 s over 20 tests: 5 s a test
    files = {"fast_many.py": 18, "new_big.py": 8, "slow_few.py": 1, "medium.py": 1, "new_small.py": 1}
    assert longest_first(files, table) == ["slow_few.py", "new_big.py", "medium.py", "fast_many.py", "new_small.py"]


def test_the_committed_table_names_files_of_the_suite() -> None:
    table = durations_read(TABLE)
    assert table, f"{TABLE} is empty: `make test-durations` writes it"
    missing = [name for name in table if not (ROOT / name).is_file()]
    # A file renamed or removed since the last measurement is harmless (its new name is estimated),
    # but a table mostly of stale names no longer orders anything.
    assert len(missing) < len(table) / 4, f"stale entries in {TABLE}: {missing}"


def test_bad_table_is_refused_with_its_path(tmp_path: Path) -> None:
    bad = tmp_path / "durations.json"
    bad.write_text('{"tests/a.py": "slow"}')
    with pytest.raises(ValueError, match="durations.json: expected a JSON object of test file -> seconds"):
        durations_read(bad)


def test_a_real_xdist_run_follows_the_table_and_writes_a_new_one(tmp_path: Path) -> None:
    """One xdist worker runs the files in the order the controller hands them out: xdist's own
    order would be the file with most tests first."""
    order = tmp_path / "order.txt"
    (tmp_path / "test_many.py").write_text(
        "import os\n" + "".join(f"def test_{i}():\n    open(os.environ['ORDER'], 'a').write('many\\n')\n"
                                for i in range(5)))
    (tmp_path / "test_one_slow.py").write_text(
        "import os\ndef test_slow():\n    open(os.environ['ORDER'], 'a').write('slow\\n')\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"test_many.py": 1.0, "test_one_slow.py": 50.0}))
    written = tmp_path / "written.json"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.xdist_schedule", "-p", "no:django", "-p", "no:cacheprovider",
         "-n", "1", "--dist", "loadfile", f"--file-durations={table}", f"--file-durations-write={written}", "-q"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "ORDER": str(order), "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout + run.stderr
    assert order.read_text().split() == ["slow"] + ["many"] * 5
    assert sorted(json.loads(written.read_text())) == ["test_many.py", "test_one_slow.py"]
