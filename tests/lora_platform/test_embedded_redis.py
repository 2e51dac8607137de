"""The embedded Redis: a process that starts one stops it when it exits, even with other clients
still connected (a Celery pool, say), and `make up`'s persistent kind keeps its data across runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
# Starts the server, holds a second connection as kombu's pool would, runs `action`, prints the pid.
SCRIPT = """
import sys, redis
from pathlib import Path
import lora_platform.embedded_redis as embedded
url = embedded.redis_url_or_embedded(None, Path(sys.argv[1]), persist=sys.argv[2] == "persist")
held = redis.Redis.from_url(url)
held.ping()
{action}
print(embedded._server.pid, flush=True)
"""


def run(var: Path, action: str, persist: bool) -> tuple[int, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("REDIS_URL", "DJANGO_SETTINGS_MODULE")}
    env["PYTHONPATH"] = str(ROOT)
    # A session of its own: a process group of its own, so a per-group server of its own.
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(action=action), str(var),
                             "persist" if persist else "throwaway"], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=120, check=True, start_new_session=True)
    lines = result.stdout.strip().splitlines()
    return int(lines[-1]), "\n".join(lines[:-1])


def gone(pid: int, timeout: float = 10) -> bool:
    """Whether the server stops running within `timeout`. A zombie has stopped: the daemon's parent
    is init, which may take seconds to reap it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("persist", [False, True])
def test_the_server_stops_with_the_process_that_started_it_despite_open_connections(tmp_path: Path,
                                                                                    persist: bool) -> None:
    pid, _ = run(tmp_path / "var", "", persist)
    assert gone(pid), "the embedded redis-server outlived the process that started it"


def test_the_persistent_server_keeps_its_data_in_var_across_restarts(tmp_path: Path) -> None:
    var = tmp_path / "var"
    first, _ = run(var, "held.rpush('queue', 'task-1')", persist=True)
    assert gone(first) and (var / "redis").is_dir()
    second, output = run(var, "print(held.lrange('queue', 0, -1))", persist=True)
    assert gone(second) and output == "[b'task-1']"
    # Without persistence every process group starts empty.
    _, output = run(var, "print(held.lrange('queue', 0, -1))", persist=False)
    assert output == "[]"
