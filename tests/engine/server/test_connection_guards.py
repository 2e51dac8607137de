"""Issue 23, item 6, on the serving worker: a request that never finishes its headers is closed
after `--header-timeout` (408), a request whose body stops coming after `--body-timeout` (408),
one client address holds at most `--max-connections-per-client`
connections, and an idle keep-alive connection outlives the header timeout (the gateway's pool
relies on the worker keeping idle connections 75 s: serving.contracts.registry.WORKER_KEEP_ALIVE_S)."""

from __future__ import annotations

import http.client
import socket
import time

import pytest

from tests.lora_platform.live_web import read_response

PATIENCE_S = 30.0


@pytest.fixture(scope="module")
def guarded_worker(start_worker):
    return start_worker("--served-model-name", "base", "--header-timeout", "1", "--body-timeout", "1")


def _closed_with(sock: socket.socket) -> bytes:
    try:
        return read_response(sock)
    except TimeoutError:
        pytest.fail(f"the worker kept the connection open for {PATIENCE_S} s")


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-"],
                         ids=["nothing", "partial-headers"])
def test_a_request_that_never_finishes_its_headers_is_closed_after_the_header_timeout(guarded_worker, sent):
    with socket.create_connection(("127.0.0.1", guarded_worker.port), timeout=PATIENCE_S) as sock:
        sock.sendall(sent)
        answer = _closed_with(sock)
    assert answer.startswith(b"HTTP/1.1 408 ") and b"(1 s)" in answer, answer


def test_a_body_that_stops_coming_is_closed_after_the_body_timeout(guarded_worker):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")
    with socket.create_connection(("127.0.0.1", guarded_worker.port), timeout=PATIENCE_S) as sock:
        sock.sendall(head + b'{"model": "')  # and never the rest
        answer = _closed_with(sock)
    assert answer.startswith(b"HTTP/1.1 408 ") and b"body timeout (1 s)" in answer, answer


def test_one_client_gets_at_most_its_cap_of_connections(start_worker):
    # A header timeout far longer than the test, so the connections it holds stay open on their own.
    capped = start_worker("--served-model-name", "base", "--header-timeout", "600", "--max-connections-per-client", "4")
    held = [socket.create_connection(("127.0.0.1", capped.port), timeout=PATIENCE_S) for _ in range(4)]
    try:
        held[0].sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert held[0].recv(65536).startswith(b"HTTP/1.1 200 ")
        with socket.create_connection(("127.0.0.1", capped.port), timeout=PATIENCE_S) as extra:
            answer = _closed_with(extra)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"at most 4" in answer, answer
    finally:
        for sock in held:
            sock.close()


def test_an_idle_keep_alive_connection_outlives_the_header_timeout(guarded_worker):
    connection = http.client.HTTPConnection("127.0.0.1", guarded_worker.port, timeout=PATIENCE_S)
    try:
        sockets = []
        for idle in (2.5, 0):  # idle past the 1 s header timeout between the two requests
            connection.request("GET", "/health")
            response = connection.getresponse()
            assert response.status == 200 and response.read() == b'{"status":"ready"}'
            sockets.append(connection.sock)
            time.sleep(idle)
        assert sockets[0] is sockets[1], "the worker closed the idle connection"
    finally:
        connection.close()
