"""Issue 16, item 2: a Redis outage never fails a request whose data is committed, never leaves a row
without its file, and what it could not send is sent by the sweep once Redis is back.

Real parts only: the web app under uvicorn, a Celery worker and a redis-server of the test's own
(stopped, frozen with SIGSTOP, restarted by the test; never the machine's Redis).
"""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from django.utils import timezone

from serving.registry.storage import get_storage
from tests import zygote
from training.models import Dataset, TrainingJob
from training_support import ROOT, chat_lines, jsonl, process_env, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

SMALL = {"n_epochs": 1, "batch_size": 4, "learning_rate": 1e-2, "r": 4, "lora_alpha": 8, "lora_dropout": 0.0}
# Far above REDIS_SOCKET_TIMEOUT times the publish attempts; a request that hangs on Redis fails it.
REQUEST_TIMEOUT_S = 60


def upload(web, key: str, name: str) -> httpx.Response:
    return httpx.post(f"{web.url}/api/v1/datasets", headers={"Authorization": f"Bearer {key}"},
                      files={"file": (name, jsonl(chat_lines(2)), "application/jsonl")}, timeout=REQUEST_TIMEOUT_S)


def dataset_status(dataset_id: int) -> str:
    return Dataset.objects.get(pk=dataset_id).status


def send_sweep(settings, redis_url: str, log: Path) -> None:
    """What beat sends every minute, sent now through the test's Redis with Celery's own CLI (forked from
    the zygote, as the worker is, instead of a cold interpreter importing Django and Celery)."""
    with log.open("ab") as output:
        process = zygote.popen([sys.executable, "-m", "celery", "-A", "lora_platform", "call",
                                "training.tasks.training_jobs_sweep"],
                               cwd=ROOT, env=process_env(settings, {"REDIS_URL": redis_url}), stdout=output,
                               stderr=subprocess.STDOUT)
    assert process.wait(timeout=120) == 0, log.read_text(errors="replace")


def assert_every_row_has_its_file_and_no_file_lacks_a_row() -> None:
    keys = set(Dataset.objects.values_list("storage_key", flat=True))
    assert set(get_storage().list("datasets/")) == keys


def test_uploads_and_jobs_survive_a_stopped_then_frozen_redis_and_run_once_it_is_back(
        platform, tenant_a, own_redis, start_web, start_worker, settings, tmp_path):
    web = start_web(REDIS_URL=own_redis.url)
    start_worker(REDIS_URL=own_redis.url)
    response = upload(web, tenant_a.key, "ready.jsonl")
    assert response.status_code == 201, response.text
    ready_id = response.json()["id"]
    wait_for(lambda: dataset_status(ready_id) == "ready", 120, "validation with Redis up")

    own_redis.stop()
    started = time.monotonic()
    response = upload(web, tenant_a.key, "during-outage.jsonl")
    stopped_upload_s = time.monotonic() - started
    assert response.status_code == 201, response.text
    unsent = Dataset.objects.get(pk=response.json()["id"])
    assert unsent.status == "uploaded" and unsent.validation_queued_at is None
    assert get_storage().exists(unsent.storage_key)

    response = httpx.post(f"{web.url}/api/v1/training-jobs", headers={"Authorization": f"Bearer {tenant_a.key}"},
                          json={"training_file": ready_id, "adapter": "outage-bot", "hyperparameters": SMALL,
                                "seed": 1}, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 201, response.text
    job = TrainingJob.objects.get(pk=response.json()["id"])
    # Not sent, so it does not count toward the limit: the next dispatch sends it (before: `queued` with
    # dispatched_at set, never started, counting toward the tier's limit).
    assert job.status == "queued" and job.dispatched_at is None

    own_redis.start()
    own_redis.freeze()
    try:
        started = time.monotonic()
        response = upload(web, tenant_a.key, "while-frozen.jsonl")
        frozen_upload_s = time.monotonic() - started
        # Answered while Redis is still frozen (before the fix it waited as long as Redis stayed frozen).
        assert own_redis.frozen
        assert response.status_code == 201, response.text
        frozen = Dataset.objects.get(pk=response.json()["id"])
        assert get_storage().exists(frozen.storage_key)
    finally:
        own_redis.thaw()
    print(f"upload with Redis stopped: {stopped_upload_s:.2f} s; with Redis frozen: {frozen_upload_s:.2f} s")

    # The sweep (beat's minute, sent by hand here) finds what was not sent.
    Dataset.objects.filter(pk=unsent.pk).update(created_at=timezone.now() - timedelta(minutes=2))
    send_sweep(settings, own_redis.url, tmp_path / "sweep.log")
    wait_for(lambda: dataset_status(unsent.pk) == "ready", 120, "the unsent dataset's validation")
    wait_for(lambda: TrainingJob.objects.get(pk=job.pk).status == "succeeded", 240, "the job sent by the sweep")
    # The frozen upload's task was either sent after all (Redis answered once thawed) or is swept.
    if dataset_status(frozen.pk) == "uploaded":
        Dataset.objects.filter(pk=frozen.pk).update(created_at=timezone.now() - timedelta(minutes=2))
        send_sweep(settings, own_redis.url, tmp_path / "sweep.log")
    wait_for(lambda: dataset_status(frozen.pk) == "ready", 120, "the frozen upload's validation")
    assert TrainingJob.objects.get(pk=job.pk).attempts == 1
    assert_every_row_has_its_file_and_no_file_lacks_a_row()
