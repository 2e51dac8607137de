"""Each pytest-xdist worker gets its own Redis database (tests/worker_isolation.py, docs/testing.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lora_platform.embedded_redis import celery_redis_url
from tests.worker_isolation import CONTROLLER_REDIS_URL, worker_index, worker_redis_url

ROOT = Path(__file__).resolve().parents[1]

RECORDER = '''
import json, os
from pathlib import Path


def test_record_this_workers_urls(worker_id):
    from django.conf import settings

    Path(os.environ["ISOLATION_OUT"], worker_id + ".json").write_text(json.dumps({
        "redis": settings.REDIS_URL, "broker": settings.CELERY_BROKER_URL,
        "backend": settings.CELERY_RESULT_BACKEND, "env": os.environ["REDIS_URL"],
    }))
'''


@pytest.mark.parametrize(("url", "index", "expected"), [
    ("redis://127.0.0.1:6379/10", 1, "redis://127.0.0.1:6379/11"),
    ("redis://:secret@cache:6379", 2, "redis://:secret@cache:6379/2"),
    ("rediss://cache:6380/3", 0, "rediss://cache:6380/3"),
    ("unix:///tmp/run/redis.socket", 1, "unix:///tmp/run/redis.socket?db=1"),
    ("unix:///tmp/run/redis.socket?db=4", 2, "unix:///tmp/run/redis.socket?db=6"),
])
def test_a_worker_moves_to_the_base_database_plus_its_index(url: str, index: int, expected: str) -> None:
    assert worker_redis_url(url, index) == expected


def test_what_is_not_a_worker_or_a_redis_url_is_refused_by_name() -> None:
    assert worker_index("gw12") == 12
    with pytest.raises(ValueError, match="'master' is not an xdist worker id"):
        worker_index("master")
    with pytest.raises(ValueError, match="memcached://cache:11211"):
        worker_redis_url("memcached://cache:11211", 1)


def test_this_worker_uses_its_own_redis_database(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Each worker's settings (and so Celery, and every process it starts) point at a database of
    their own on the run's Redis. Under xdist (`make test`) this worker checks itself against the URL
    its controller handed on; in a plain run, a real `pytest -n 2` is started and both are checked."""
    workerinput = getattr(request.config, "workerinput", None)
    if workerinput is not None:
        from django.conf import settings

        wanted = worker_redis_url(workerinput[CONTROLLER_REDIS_URL], worker_index(workerinput["workerid"]))
        assert settings.REDIS_URL == os.environ["REDIS_URL"] == wanted
        assert settings.CELERY_BROKER_URL == settings.CELERY_RESULT_BACKEND == celery_redis_url(wanted)
        return
    (tmp_path / "test_recorder.py").write_text(RECORDER)
    out = tmp_path / "out"
    out.mkdir()
    base_url = os.environ["REDIS_URL"]  # the embedded server's or CI's, as a controller would hand it on
    env = {**os.environ, "ISOLATION_OUT": str(out), "REDIS_URL": base_url}
    env.pop("PYTEST_XDIST_WORKER", None)  # the child run's controller is no worker, even when this one is
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT),
         "-p", "no:cacheprovider", "-q", "-n", "2", "--dist", "each", str(tmp_path / "test_recorder.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    seen = {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}
    assert sorted(seen) == ["gw0", "gw1"]
    for index, worker in enumerate(("gw0", "gw1")):
        wanted = worker_redis_url(base_url, index)
        assert seen[worker]["redis"] == seen[worker]["env"] == wanted
        # Celery spells a unix socket's database its own way; it must be the same database.
        assert seen[worker]["broker"] == seen[worker]["backend"] == celery_redis_url(wanted)
    assert seen["gw0"]["redis"] != seen["gw1"]["redis"]
