"""Issue 23, item 6: the web server closes connections that never finish their request headers
(nothing sent, a partial request line or headers, or headers trickled a byte at a time) after its
header timeout, and a request whose body stops coming after its body timeout (a body that keeps
coming is read whatever it takes), closes idle keep-alive connections after its idle timeout, and refuses more
connections from one client address than its cap. Real sockets against the web process as the
launcher starts it, with small settings."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from tests.lora_platform.live_web import LiveWeb, read_response, web_env

# No database mark: the tests speak to the web process over sockets and never query the database
# themselves (the fixtures unblock it to read its URL). A transactional mark flushed the test
# database after each of the nine tests, 0.3-0.6 s each, for rows nobody wrote.

MAX_PER_CLIENT = 6
# How long a test waits for the server to act before it calls the connection "left open": far
# above the 1 s settings (no timing is asserted), far below a run's patience.
PATIENCE_S = 30.0


def _start(django_db_blocker, tmp_path_factory: pytest.TempPathFactory, **settings: str) -> LiveWeb:
    tmp = tmp_path_factory.mktemp("server-timeouts")
    with django_db_blocker.unblock():
        env = web_env(tmp)
    return LiveWeb({**env, **settings}, tmp / "web.log")


@pytest.fixture(scope="module")
def web(django_db_setup, django_db_blocker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveWeb]:
    server = _start(django_db_blocker, tmp_path_factory, WEB_HEADER_TIMEOUT_SECONDS="1", WEB_KEEP_ALIVE_SECONDS="1",
                    WEB_BODY_TIMEOUT_SECONDS="1")
    yield server
    server.stop()


@pytest.fixture
def capped_web(django_db_setup, django_db_blocker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveWeb]:
    # Timeouts far longer than the test, so the connections it holds stay open on their own.
    server = _start(django_db_blocker, tmp_path_factory, WEB_HEADER_TIMEOUT_SECONDS="600",
                    WEB_KEEP_ALIVE_SECONDS="600", WEB_MAX_CONNECTIONS_PER_CLIENT=str(MAX_PER_CLIENT))
    yield server
    server.stop()


def _closed_with(sock: socket.socket) -> bytes:
    """What the server sent before closing; fails if it kept the connection open."""
    try:
        return read_response(sock)
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {PATIENCE_S} s")


@pytest.mark.parametrize("sent", [b"", b"GET /api/schema/ HT", b"GET /api/schema/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"],
                         ids=["nothing", "partial-request-line", "partial-headers"])
def test_a_request_that_never_finishes_its_headers_is_closed_after_the_header_timeout(web, sent):
    with web.connect(timeout=PATIENCE_S) as sock:
        sock.sendall(sent)
        answer = _closed_with(sock)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"header timeout" in answer.lower()


def test_headers_trickled_a_byte_at_a_time_do_not_extend_the_header_timeout(web):
    request = b"GET /api/schema/ HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Slow: " + b"a" * 10_000
    with web.connect(timeout=PATIENCE_S) as sock:
        deadline = time.monotonic() + PATIENCE_S
        for byte in request:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"the server took a byte every 0.1 s for {PATIENCE_S} s")
            time.sleep(0.1)
        answer = _closed_with(sock)
    assert answer.startswith(b"HTTP/1.1 408 ") or answer == b"", answer


def _post_head(length: int) -> bytes:
    return (f"POST /api/v1/tenant HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_a_body_that_stops_coming_is_closed_after_the_body_timeout(web):
    with web.connect(timeout=PATIENCE_S) as sock:
        sock.sendall(_post_head(100) + b'{"a": "')  # and never the rest
        answer = _closed_with(sock)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"body timeout" in answer.lower()


def test_a_body_that_keeps_coming_is_read_past_the_body_timeout(web):
    chunks = [b'{"padding": "'] + [b"x" * 10] * 15 + [b'"}']
    with web.connect(timeout=PATIENCE_S) as sock:
        sock.sendall(_post_head(sum(map(len, chunks))))
        for chunk in chunks:  # 3 s in all, a fifth of the 1 s timeout between two chunks
            sock.sendall(chunk)
            time.sleep(0.2)
        answer = _closed_with(sock)
    # Read whole and answered by the application: no key, so 401 (not the server's 408).
    assert answer.startswith(b"HTTP/1.1 401 "), answer


def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout(web):
    with web.connect(timeout=PATIENCE_S) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 "), first
        head, _, body = first.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += sock.recv(65536)
        # The request was served and the connection kept alive; left idle, the server closes it
        # without a word (what a keep-alive client expects).
        started = time.monotonic()
        assert _closed_with(sock) == b""
        print(f"idle keep-alive connection closed after {time.monotonic() - started:.2f} s")


@pytest.mark.e2e
def test_one_client_gets_at_most_its_cap_of_connections(capped_web):
    web = capped_web
    held = [web.connect(timeout=PATIENCE_S) for _ in range(MAX_PER_CLIENT)]
    try:
        # Give the server the time to accept them (it counts accepted connections).
        held[0].sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert held[0].recv(65536).startswith(b"HTTP/1.1 200 ")
        with web.connect(timeout=PATIENCE_S) as extra:
            answer = _closed_with(extra)
        assert answer.startswith(b"HTTP/1.1 503 "), answer
        assert b"retry-after" in answer.lower() and b"connections" in answer.lower()
    finally:
        for sock in held:
            sock.close()
    # Once they are closed, the same client is served again.
    deadline = time.monotonic() + PATIENCE_S
    while True:
        with web.connect(timeout=PATIENCE_S) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            answer = _closed_with(sock)
        if answer.startswith(b"HTTP/1.1 200 ") or time.monotonic() > deadline:
            break
        time.sleep(0.1)  # the server may not have seen the held sockets close yet
    assert answer.startswith(b"HTTP/1.1 200 "), answer


def test_every_web_command_line_serves_with_the_guarded_protocol():
    from pathlib import Path

    import yaml

    from lora_platform import launcher

    root = Path(__file__).resolve().parents[2]
    guarded = ["--http", "lora_platform.asgi:HTTPProtocol"]
    compose = yaml.safe_load((root / "docker-compose.yml").read_text())["services"]["web"]["command"]
    image = next(line for line in (root / "Dockerfile").read_text().splitlines() if line.startswith("CMD "))
    for argv in (launcher.web_argv("127.0.0.1", 8000), compose, json.loads(image[len("CMD "):])):
        assert any(argv[i:i + 2] == guarded for i in range(len(argv))), argv
