"""Load shedding through a real web process: with every worker over its queue bound, standard
requests get 503 server_overloaded with retry-after while vip requests still queue and are served.
The bound is the one the worker reports in its registration (half its `--max-queued-requests`),
not the gateway's default for workers that report none.

The web process and its worker serve the base model under a name of their own, so workers other
suites started in this session are no candidates here (one with room would rightly admit everyone).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import _make_tenant
from serving.contracts.registry import worker_key
from tests.gateway.conftest import wait_for_worker

pytestmark = pytest.mark.django_db(transaction=True)

BASE = "tiny-shed"


@pytest.fixture(scope="module")
def shed_web(start_web):
    # The default bound is far above anything this test queues: only the worker's reported bound
    # can shed.
    return start_web(BASE_MODEL_NAME=BASE, GATEWAY_SHED_DEFAULT_QUEUE_BOUND="1000")


def complete(web, key: str, max_tokens: int) -> httpx.Response:
    body = {"model": BASE, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}
    return httpx.post(f"{web.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def relaying(web) -> float:
    """What the web process is relaying to workers now (its in-flight gauge)."""
    for line in httpx.get(f"{web.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("loraplex_gateway_requests_in_flight "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_relaying(web, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while relaying(web) < count:
        assert time.monotonic() < deadline, f"the gateway is not relaying {count} requests"
        time.sleep(0.05)


def test_below_vip_is_shed_when_every_worker_is_full_and_vip_still_queues(registry, shed_web, start_worker,
                                                                          tenant_a, redis_client):
    # Room for 1 running + 4 waiting; the gateway sheds from 2 waiting (half of 4) on.
    start_worker("rs-shed", "--served-model-name", BASE, "--max-num-seqs", "1", "--max-queued-requests", "4")
    wait_for_worker(redis_client, "rs-shed")
    registration = json.loads(redis_client.get(worker_key("rs-shed")))
    assert registration["max_queued_requests"] == 4
    assert registration["gpu_memory_free_bytes"] is None  # a CPU worker has no GPU memory to report
    vip = _make_tenant("vip-co", tier="vip")
    assert complete(shed_web, tenant_a.key, 2).status_code == 200  # room: standard is served

    with ThreadPoolExecutor(8) as pool:
        long_vip = [pool.submit(complete, shed_web, vip.key, 256) for _ in range(3)]
        # The gateway counts what it relays to a worker on top of the worker's reported queue, so once
        # it relays the three vip requests the worker is over its bound of 2, whatever the heartbeat says.
        wait_relaying(shed_web, 3)
        standard = [pool.submit(complete, shed_web, tenant_a.key, 2) for _ in range(3)]
        more_vip = pool.submit(complete, shed_web, vip.key, 2)
        shed = [future.result() for future in standard]
        vip_replies = [future.result() for future in [*long_vip, more_vip]]

    assert all(reply.status_code == 200 for reply in vip_replies), [r.text for r in vip_replies]
    for reply in shed:
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert error["code"] == "server_overloaded" and "rs-shed" in error["message"]
        assert "/2 waiting" in error["message"]  # judged by the reported bound
        assert reply.headers["retry-after"] == "1"
    # Once the queue drains, standard traffic is admitted again.
    deadline = time.monotonic() + 30
    while complete(shed_web, tenant_a.key, 2).status_code != 200:
        assert time.monotonic() < deadline, "standard requests still shed after the queue drained"
        time.sleep(0.5)
