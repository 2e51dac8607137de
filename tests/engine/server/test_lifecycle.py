"""Requests ending early and the worker ending: a client that disconnects frees its request's KV
blocks at once; an over-full queue is refused with 503; an API key guards /v1/*; on SIGTERM no
request hangs and the process exits within its grace period."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.engine.server.conftest import LONG_TOKENS

LONG = {"prompt": "Once upon a time", "max_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0}


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_client_disconnect_aborts_and_frees_kv_blocks(worker, stream):
    aborted = worker.metric("loraplex_requests_total", model="beta", status="aborted")
    generated = worker.metric("loraplex_generation_tokens_total", model="beta")
    body = dict(LONG, model="beta", stream=stream)
    with httpx.Client(base_url=worker.url, timeout=120) as client:
        if stream:
            with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                for _ in range(4):
                    next(lines)
                assert worker.metric("loraplex_kv_cache_blocks_used") > 0
            # Leaving the block closed the connection mid-stream.
        else:
            with pytest.raises(httpx.ReadTimeout):
                client.post("/v1/completions", json=body, timeout=1.0)
    wait_for(lambda: worker.metric("loraplex_requests_total", model="beta", status="aborted") == aborted + 1)
    wait_for(lambda: worker.metric("loraplex_num_requests_running") == 0)
    assert worker.metric("loraplex_kv_cache_blocks_used") == 0
    assert worker.metric("loraplex_num_requests_waiting") == 0
    # It stopped early: far fewer tokens than it asked for were generated.
    assert worker.metric("loraplex_generation_tokens_total", model="beta") - generated < LONG_TOKENS


def test_overload_api_key_and_graceful_shutdown(start_worker):
    grace = 1.0
    worker = start_worker("--max-num-seqs", "2", "--max-queued-requests", "1", "--api-key", "sekret",
                          "--timeout-graceful-shutdown", str(grace), "--served-model-name", "base")
    auth = {"Authorization": "Bearer sekret"}
    assert httpx.post(f"{worker.url}/v1/completions", json={"model": "base", "prompt": "x"}).status_code == 401
    wrong = httpx.get(f"{worker.url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{worker.url}/health").status_code == 200  # probes need no key

    finishes: dict[int, list[str]] = {}
    errors: list[BaseException] = []

    def stream(index: int) -> None:
        # No max_tokens: the rest of the 2048-token context, far more than a second's worth.
        body = {"model": "base", "prompt": "Once upon a time", "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{worker.url}/v1/completions", headers=auth, timeout=60, json=body) as response:
                assert response.status_code == 200
                events = [line for line in response.iter_lines() if line]
            assert events[-1] == "data: [DONE]"
            finishes[index] = [line for line in events if '"finish_reason":"' in line]
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for thread in threads[:2]:
        thread.start()
    wait_for(lambda: worker.metric("loraplex_num_requests_running") == 2)
    threads[2].start()
    # Two running (max_num_seqs 2), one queued (max_queued_requests 1): the bound is reached.
    wait_for(lambda: worker.metric("loraplex_num_requests_waiting") == 1)
    over = httpx.post(f"{worker.url}/v1/completions", headers=auth, json={"model": "base", "prompt": "x"})
    assert over.status_code == 503
    assert over.json()["error"]["code"] == "overloaded"
    assert "max_queued_requests 1" in over.json()["error"]["message"]

    signalled = time.monotonic()
    worker.signal()
    code = worker.process.wait(timeout=grace + 30)
    exited_after = time.monotonic() - signalled
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive(), "a request hung after SIGTERM"
    assert not errors, errors
    assert code == 0, worker.log()
    assert exited_after < grace + 15, exited_after
    # None could finish in the grace period: each was aborted, and its stream ended properly.
    assert sorted(finishes) == [0, 1, 2]
    assert all(len(f) == 1 and '"finish_reason":"abort"' in f[0] for f in finishes.values()), finishes
    assert "grace period over: aborting 3 request(s)" in worker.log()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{worker.url}/health", timeout=2)


def test_an_idle_connection_outlives_the_gateways_pool_expiry(worker):
    """The worker keeps an idle keep-alive connection open past the 5 s uvicorn default, so the
    gateway's pool (which drops its idle connections after UPSTREAM_IDLE_S) is always the side that
    closes first; at the default, the second request on this socket finds it closed."""
    import http.client

    from serving.contracts.registry import UPSTREAM_IDLE_S, WORKER_KEEP_ALIVE_S

    assert UPSTREAM_IDLE_S < WORKER_KEEP_ALIVE_S
    connection = http.client.HTTPConnection("127.0.0.1", worker.port, timeout=10)
    try:
        sockets = []
        for idle in (6.5, 0):  # idle past uvicorn's 5 s default between the two requests only
            connection.request("GET", "/health")
            response = connection.getresponse()
            assert response.status == 200 and response.read() == b'{"status":"ready"}'
            sockets.append(connection.sock)
            time.sleep(idle)
        assert sockets[0] is sockets[1], "the worker closed the idle connection"
    finally:
        connection.close()
