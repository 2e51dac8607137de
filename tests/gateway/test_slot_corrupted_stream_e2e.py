"""A stream stopped by a corrupted GPU slot, through a real web process and a real serving worker:
the client gets the worker's `adapter_slot_corrupted` error event and `[DONE]`, the usage record
says the stream failed, and the version's breaker holds only the worker's own failure for the
corruption, not a second one from the gateway; a stream that ends with another error event (an
engine step that failed) is still charged to the version by the gateway.

The worker runs in this process (`serve_in_process`), so the test can write into its GPU slot
while the stream runs, as a stray kernel would; it registers in the run's Redis under a key of
this module, which only this module's web process shares, so that process routes to it alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from serving.registry import services
from serving.engine.server.cli import ServerArgs
from serving.engine.server.worker import Worker
from runtime.breakers import Snapshot
from serving.registry.models import UsageRecord
from serving.registry.usage import usage_records_flush
from tests.gateway.conftest import WebProcess, upload_version, wait_for_worker
from tests.conftest import TenantFixture, _make_tenant, shared_breaker
from tests.engine.server.conftest import serve_in_process

pytestmark = pytest.mark.django_db(transaction=True)

KEY = "slot-corruption-test-key"
WORKER_ID = "gw-slot-worker"
PROMPT = [1, 45, 99, 173, 201, 32]
# The batch tier's limit per request: long enough for the stream to be decoding while the slot is
# written and checked.
LONG_TOKENS = 1024


@pytest.fixture(scope="module")
def slot_web(start_web: Callable[..., WebProcess]) -> WebProcess:
    return start_web(SERVING_WORKER_API_KEY=KEY)


@pytest.fixture
def tenant(db) -> TenantFixture:
    return _make_tenant("slot-co", tier="batch")


@pytest.fixture
def slot_worker(redis_client, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[Worker, str, ServerArgs]]:
    from django.conf import settings

    args = ServerArgs(model=str(tiny_model), device="cpu", served_model_name=[tiny_model.name], api_key=KEY,
                      redis_url=settings.REDIS_URL, worker_id=WORKER_ID, heartbeat_interval=0.5, max_loras=2,
                      max_lora_rank=16, max_model_len=2048, num_gpu_blocks_override=512, slot_verify_interval=0,
                      allowed_adapter_path=[str(tmp_path_factory.getbasetemp())])
    with serve_in_process(args) as (worker, url):
        wait_for_worker(redis_client, WORKER_ID)
        yield worker, url, args


def breaker(name: str) -> Snapshot:
    """The version's shared breaker as every gateway process reads it (thresholds: the defaults the
    web process runs with), as Redis holds it."""
    return shared_breaker(name)


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def stream_events(web: WebProcess, key: str, model: str, when_under_way: Callable[[], None]) -> tuple[str, list[dict]]:
    """(request id, every event after the first) of a long stream through the gateway; `when_under_way`
    runs once its first event has reached the client. `[DONE]` is kept as {"done": True}."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{web.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        lines = (line.removeprefix("data: ") for line in reply.iter_lines() if line)
        first = json.loads(next(lines))
        assert first["choices"][0]["text"] is not None and first["model"] == model
        when_under_way()
        rest = [{"done": True} if line == "[DONE]" else json.loads(line) for line in lines]
    return reply.headers["x-request-id"], rest


def stopped_with(events: list[dict]) -> dict:
    """The error of a stream that ended with one error event and then `[DONE]`."""
    assert events[-1] == {"done": True}, events[-3:]
    assert all("error" not in event for event in events[:-2])
    return events[-2]["error"]


def usage_status(request_id: str) -> tuple[str, int]:
    def recorded() -> bool:
        usage_records_flush()
        return UsageRecord.objects.filter(request_id=request_id).exists()

    wait_for(recorded, f"the usage record of {request_id}")
    record = UsageRecord.objects.get(request_id=request_id)
    return record.status, record.http_status


def test_a_stream_stopped_by_a_corrupted_slot_is_not_charged_to_the_version_again(
        registry, slot_web, slot_worker, tenant, adapter_dirs):
    worker, url, args = slot_worker
    assert worker.engine is not None
    engine = worker.engine.engine
    bot = services.adapter_create(tenant=tenant.tenant, name="slot-bot")
    version = upload_version(bot, adapter_dirs[0], "1.0.0")
    services.adapter_version_deploy(version=version, actor="test")
    name = f"{tenant.tenant.slug}/slot-bot@1.0.0"
    time.sleep(0.6)  # the web process's caches of served versions (GATEWAY_CACHE_SECONDS)

    warm = httpx.post(f"{slot_web.url}/v1/completions", json={"model": "slot-bot", "prompt": PROMPT, "max_tokens": 2},
                      headers={"Authorization": f"Bearer {tenant.key}"}, timeout=120)
    assert warm.status_code == 200, warm.text
    wait_for(lambda: breaker(name).calls == 1, "the warm-up call on the breaker")

    def corrupt_the_slot() -> None:
        wait_for(lambda: any(seq.num_output_tokens > 0 for seq in list(engine.scheduler.running)), "decoding")
        (info,) = engine.list_loras()
        assert info.gpu_slot is not None and info.gpu_row is not None
        with torch.no_grad():
            next(iter(engine.runner.model.lora_layers())).lora_B[0][info.gpu_row, 0] += 0.5
        repaired = httpx.post(f"{url}/v1/verify_lora_slots", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert repaired.json()["repaired"][0]["stopped"] == 1, repaired.text

    corrupted_id, events = stream_events(slot_web, tenant.key, "slot-bot", corrupt_the_slot)
    error = stopped_with(events)
    assert error["code"] == "adapter_slot_corrupted" and "slot-bot" in error["message"], error
    # Recorded as every stopped stream is: a failed request, answered 200.
    assert usage_status(corrupted_id) == ("upstream_error", 200)
    # The worker's own failure for the corruption (it records it before it answers the verify call).
    assert (breaker(name).calls, breaker(name).failures) == (2, 1)

    def break_the_step() -> None:
        (seq,) = engine.scheduler.running
        seq.lora_slot = args.max_loras + 7  # no such slot: the engine's next step fails

    failed_id, events = stream_events(slot_web, tenant.key, "slot-bot", break_the_step)
    error = stopped_with(events)
    assert error["code"] != "adapter_slot_corrupted" and "engine step failed" in error["message"], error
    assert usage_status(failed_id) == ("upstream_error", 200)
    # Another error event is the version's failure, charged by the gateway.
    wait_for(lambda: breaker(name).failures == 2, "the gateway's failure for the broken stream")

    # A call after both is on the breaker once the gateway has recorded it, and by then the stream
    # stopped by the corruption (recorded long before) has added nothing to the worker's failure.
    after = httpx.post(f"{slot_web.url}/v1/completions", json={"model": "slot-bot", "prompt": PROMPT, "max_tokens": 2},
                       headers={"Authorization": f"Bearer {tenant.key}"}, timeout=120)
    assert after.status_code == 200, after.text
    wait_for(lambda: breaker(name).calls == 4, "the last call on the breaker")
    assert breaker(name).failures == 2
