"""The worker's room for requests in flight, shared between tenants (serving.engine.server.waiting_room):
one tenant filling it leaves the last places to the others, and the worker answers the flooder's
next request 429 tenant_share_exceeded while another tenant's still comes in."""

from __future__ import annotations

import threading

import httpx
import pytest

from serving.engine.server.cli import ServerArgs
from serving.engine.server.waiting_room import WaitingRoom
from tests.engine.server.conftest import serve_in_process


def test_a_flooding_tenant_leaves_the_last_places_to_others():
    room = WaitingRoom(16)  # two places reserved
    for index in range(14):
        assert room.refusal("tenant-a") is None
        room.enter(f"a{index}", "tenant-a")
    # 14 of 16 held by A: the rest is for tenants under an equal share.
    assert room.refusal("tenant-a") == "tenant_share"
    assert room.refusal("tenant-b") is None
    room.enter("b0", "tenant-b")
    assert room.refusal("tenant-b") is None  # B holds 1, under 16 // 3
    room.enter("b1", "tenant-b")
    assert room.refusal("tenant-c") == "full"
    room.leave("a0")
    assert room.refusal("tenant-a") == "tenant_share"
    assert room.refusal("tenant-c") is None


def test_the_operators_unsalted_requests_are_bounded_by_the_room_alone():
    room = WaitingRoom(8)
    for index in range(8):
        assert room.refusal(None) is None
        room.enter(f"op{index}", None)
    assert room.refusal(None) == "full"


def test_below_the_reserve_no_tenant_is_refused_and_leaving_frees_the_share():
    room = WaitingRoom(8)  # one place reserved
    for index in range(7):
        assert room.refusal("tenant-a") is None
        room.enter(f"a{index}", "tenant-a")
    assert room.refusal("tenant-a") == "tenant_share"
    room.leave("a3")
    room.leave("a3")  # twice: released once
    assert len(room) == 6 and room.held("tenant-a") == 6
    assert room.refusal("tenant-a") is None


@pytest.mark.slow
def test_the_worker_refuses_a_flooders_request_but_admits_another_tenants(tiny_model):
    # Capacity 1 + 7 = 8, one place reserved: tenant A's 7 streams fill the rest.
    args = ServerArgs(model=str(tiny_model), device="cpu", max_num_seqs=1, max_queued_requests=7, max_loras=0)
    with serve_in_process(args) as (worker, url):
        release = threading.Event()
        held: list[httpx.Response] = []

        def stream(salt: str) -> None:
            # Near the context (2,048): the running stream must not finish, and leave the room, before the
            # checks below (200 tokens did, on a loaded machine).
            body = {"model": str(tiny_model), "prompt": "a", "max_tokens": 2000, "ignore_eos": True, "stream": True,
                    "cache_salt": salt}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
                held.append(response)
                release.wait(120)

        threads = [threading.Thread(target=stream, args=("tenant-a",)) for _ in range(7)]
        for thread in threads:
            thread.start()
        try:
            while len(worker._inflight) < 7:
                release.wait(0.05)
            quick = {"model": str(tiny_model), "prompt": "b", "max_tokens": 1}
            refused = httpx.post(f"{url}/v1/completions", json={**quick, "cache_salt": "tenant-a"}, timeout=60)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "tenant_share_exceeded"
            admitted = httpx.post(f"{url}/v1/completions", json={**quick, "cache_salt": "tenant-b"}, timeout=120)
            assert admitted.status_code == 200, admitted.text
        finally:
            release.set()
            for thread in threads:
                thread.join(120)
        assert all(response.status_code == 200 for response in held)
