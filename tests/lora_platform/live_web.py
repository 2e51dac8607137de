"""The web process as `make up` starts it (the launcher's command line), on this run's test database
and Redis, for tests that speak raw HTTP/1.1 over sockets to it."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.gateway.conftest import WebProcess, _database_url


class LiveWeb(WebProcess):
    """A started web process, with what raw-socket tests read of it."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        super().__init__({"DJANGO_DEBUG": "0", **env}, log_path)
        self.wait_ready()

    def connect(self, timeout: float = 30.0) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)

    def written_bytes(self) -> int:
        """What the server process has passed to write() so far, files and sockets alike (Linux's
        /proc/<pid>/io `wchar`): a body spooled to a temporary file shows up here."""
        for line in Path(f"/proc/{self.process.pid}/io").read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "wchar":
                return int(value)
        raise AssertionError("no wchar in /proc/<pid>/io")


def web_env(tmp_path: Path) -> dict[str, str]:
    """The test database and Redis of this run (the caller's fixture must have set up the database)."""
    from django.conf import settings

    return {"DATABASE_URL": _database_url(), "REDIS_URL": settings.REDIS_URL,
            "STORAGE_URL": f"file://{tmp_path / 'storage'}", "LORAPLEX_VAR_DIR": str(tmp_path / "var")}


def read_response(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received
