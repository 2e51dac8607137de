"""Under pytest-xdist, each worker gets a Redis database of its own (docs/testing.md).

A pytest plugin (`-p tests.worker_isolation` in pyproject's addopts), not part of tests/conftest.py,
because it must run before pytest-django imports the settings, which read REDIS_URL once
(`settings.REDIS_URL`, the Celery broker and result URLs): an early plugin is imported while pytest
parses its arguments, before any conftest and before pytest-django's setup.

The controller process loads the settings first (pytest-django sets Django up there too), so when
REDIS_URL is unset it starts the run's embedded Redis and exports its unix-socket URL; the workers it
then spawns inherit that URL (or CI's redis://…/N). Each worker moves it to database base + its index
(gw0 → N, gw1 → N+1, …): `redis_client` flushes its database before and after every test, and the
session's serving workers, web processes and Celery workers heartbeat, queue and count there, so two
workers must never share one. Everything a test starts inherits the worker's REDIS_URL.

The rest is per worker already: pytest-django suffixes the test database (test_…_gw0; on SQLite
the file lives in the worker's own temporary directory, see tests/conftest.py), each worker has its
own basetemp, and servers bind ports chosen by `free_port()`.
"""

from __future__ import annotations

import os
import re
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import pytest

WORKER_ENV = "PYTEST_XDIST_WORKER"
# The controller's REDIS_URL, handed to each worker (tests/test_worker_isolation.py checks against it).
CONTROLLER_REDIS_URL = "controller_redis_url"


def worker_index(worker_id: str) -> int:
    """gw3 → 3."""
    match = re.fullmatch(r"gw(\d+)", worker_id)
    if match is None:
        raise ValueError(f"{WORKER_ENV}={worker_id!r} is not an xdist worker id (gw<N>)")
    return int(match.group(1))


def worker_redis_url(url: str, index: int) -> str:
    """The URL of database base + index on the same server: redis://h:p/N (rediss too) or
    unix:///socket?db=N, the two forms REDIS_URL takes here."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        query = parse_qs(parts.query)
        base = int(query.get("db", ["0"])[0])
        query["db"] = [str(base + index)]
        # Spelled out: urlunsplit would drop the empty host, and unix:/path is not a Redis URL.
        return f"unix://{parts.path}?{urlencode(query, doseq=True)}"
    if parts.scheme in ("redis", "rediss"):
        base = int(parts.path.strip("/") or 0)
        return urlunsplit(parts._replace(path=f"/{base + index}"))
    raise ValueError(f"REDIS_URL={url!r}: a worker's own database needs a redis://, rediss:// or unix:// URL")


def _isolate_this_worker() -> None:
    worker_id = os.environ.get(WORKER_ENV)
    url = os.environ.get("REDIS_URL")
    # Not a worker (a plain run, or the controller); or a worker without Django configured in the
    # controller (the accelerator machine), where nothing uses Redis.
    if worker_id is None or not url:
        return
    os.environ["REDIS_URL"] = worker_redis_url(url, worker_index(worker_id))


_isolate_this_worker()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, on the controller
def pytest_configure_node(node: object) -> None:
    node.workerinput[CONTROLLER_REDIS_URL] = os.environ.get("REDIS_URL", "")  # type: ignore[attr-defined]
