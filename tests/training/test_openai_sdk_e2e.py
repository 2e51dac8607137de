"""OpenAI's fine-tuning flow with the official `openai` SDK, unchanged, against real processes.

A web process (uvicorn), a Celery worker and a serving worker, on this test's database, Redis and
storage: upload a JSONL → create a job at once (it waits in `validating_files`) → poll `retrieve`
until `succeeded` → `list_events` shows the loss falling and token accuracy → `checkpoints.list` →
chat with `fine_tuned_model` through the gateway. Then cancel a running job (nothing published)
and check that another tenant sees none of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from serving.registry.models import AdapterVersion
from serving.registry.storage import get_storage
from tests.gateway.conftest import WebProcess
from tests.engine.server.conftest import WorkerProcess
from training.models import TrainingJob
from training_support import BASE_MODEL_NAME, QA, chat_lines, database_url, jsonl, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

SERVING_KEY = "ftapi-e2e-serving-key"
FINAL = ("succeeded", "failed", "cancelled")


@pytest.fixture
def processes(platform, settings, start_worker, base_model_dir: Path, tmp_path: Path
              ) -> Iterator[Callable[[str], openai.OpenAI]]:
    """Celery worker, web process and serving worker up; yields `sdk(api_key)` → a client of the web.

    The three start at once (none needs another to come up), then each is waited for."""
    web = WebProcess({
        "DATABASE_URL": database_url(), "REDIS_URL": settings.REDIS_URL, "STORAGE_URL": settings.STORAGE_URL,
        "BASE_MODEL_PATH": str(base_model_dir), "BASE_MODEL_NAME": BASE_MODEL_NAME, "BASE_MODEL_ALIASES": "",
        "SERVING_WORKER_API_KEY": SERVING_KEY, "LORAPLEX_VAR_DIR": str(tmp_path / "var"), "DJANGO_DEBUG": "0",
    }, tmp_path / "web.log")
    serving = None
    try:
        serving = WorkerProcess(base_model_dir, [
            "--served-model-name", BASE_MODEL_NAME, "--redis-url", settings.REDIS_URL, "--worker-id", "ftapi-e2e",
            "--heartbeat-interval", "0.5", "--api-key", SERVING_KEY, "--max-loras", "2", "--max-lora-rank", "16",
        ], tmp_path / "serving.log", env={"STORAGE_URL": settings.STORAGE_URL})
        start_worker(TRAINING_CHECKPOINT_EVERY_STEPS=8, TRAINING_LOG_EVERY_STEPS=4)
        web.wait_ready()
        serving.wait_ready()
        yield lambda key: openai.OpenAI(base_url=f"{web.url}/v1", api_key=key, max_retries=0, timeout=120)
    finally:
        if serving is not None:
            serving.stop()
        web.stop()


def wait_final(client: openai.OpenAI, job_id: str, timeout: float = 400):
    """`retrieve` until the job ends, as an SDK user polls; the statuses seen on the way, and the job."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if not seen or seen[-1] != job.status:
            seen.append(job.status)
        if job.status in FINAL:
            return seen, job
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} did not end in {timeout}s; statuses {seen}")


def test_the_openai_fine_tuning_flow_runs_unchanged(processes, tenant_a, tenant_b):
    client = processes(tenant_a.key)
    training = client.files.create(file=("train.jsonl", jsonl(chat_lines(repeat=2))), purpose="fine-tune")
    validation = client.files.create(file=("valid.jsonl", jsonl(chat_lines(repeat=1))), purpose="fine-tune")
    # Created at once, as OpenAI's guides do: the job waits for its files' validation.
    job = client.fine_tuning.jobs.create(
        model=BASE_MODEL_NAME, training_file=training.id, validation_file=validation.id, suffix="support-bot",
        seed=7, hyperparameters={"n_epochs": 8, "batch_size": 4, "learning_rate_multiplier": 50},
        extra_body={"hyperparameters": {"n_epochs": 8, "batch_size": 4, "learning_rate_multiplier": 50,
                                        "lora_dropout": 0.0}},
    )
    assert job.status in ("validating_files", "queued", "running")
    seen, job = wait_final(client, job.id)
    assert job.status == "succeeded", (seen, job.error)
    assert seen[-2:] == ["running", "succeeded"]
    assert job.fine_tuned_model == "support-bot@1.0.0" and job.trained_tokens > 0 and job.finished_at
    assert client.files.retrieve(training.id).status == "processed"

    metrics = [event.data for event in client.fine_tuning.jobs.list_events(job.id, limit=5)
               if event.type == "metrics"][::-1]
    # A 32-step job logs every step (training.pace.log_interval: at least 100 points a job).
    assert [item["step"] for item in metrics] == list(range(1, 33))
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"] - 0.3, metrics
    assert metrics[-1]["train_mean_token_accuracy"] > metrics[0]["train_mean_token_accuracy"], metrics
    assert "valid_loss" in metrics[-1]
    results = client.files.content(job.result_files[0]).content.decode().splitlines()
    assert results[0].startswith("step,train_loss,train_accuracy,valid_loss") and len(results) == 1 + len(metrics)
    assert results[-1].split(",")[:2] == ["32", str(metrics[-1]["train_loss"])]
    checkpoints = list(client.fine_tuning.jobs.checkpoints.list(job.id))
    assert checkpoints and all(item.step_number % 8 == 0 for item in checkpoints)
    assert checkpoints[0].fine_tuned_model_checkpoint == (
        f"ft:{BASE_MODEL_NAME}:alice-co:support-bot:{job.id}:ckpt-step-{checkpoints[0].step_number}")
    assert checkpoints[0].metrics.train_loss is not None

    # The SDK user's next line: the name the job gave is a model the gateway serves.
    question, _ = QA[0]
    reply = client.chat.completions.with_raw_response.create(
        model=job.fine_tuned_model, temperature=0, max_tokens=8,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": question}])
    assert reply.headers["x-loraplex-adapter-version"] == "1.0.0"
    assert reply.parse().model == job.fine_tuned_model and reply.parse().choices[0].message.content
    versions = httpx.get(f"{client.base_url}".replace("/v1/", "/api/v1/") + "adapters/support-bot/versions",
                         headers={"Authorization": f"Bearer {tenant_a.key}"}).json()
    assert [(item["version"], item["status"]) for item in versions["data"]] == [("1.0.0", "ready")]

    cancel_a_running_job(client, training.id)

    other = processes(tenant_b.key)
    assert list(other.files.list()) == [] and list(other.fine_tuning.jobs.list()) == []
    for call, ident in ((other.files.retrieve, training.id), (other.fine_tuning.jobs.retrieve, job.id),
                        (other.fine_tuning.jobs.list_events, job.id)):
        with pytest.raises(openai.NotFoundError):
            call(ident)


def cancel_a_running_job(client: openai.OpenAI, file_id: str) -> None:
    """Cancelled while running, a job stops at its next step and leaves no version, artifact or checkpoint."""
    job = client.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=file_id, suffix="support-bot",
                                         hyperparameters={"n_epochs": 50})
    pk = int(job.id.removeprefix("ftjob-"))
    # The estimate counts from the end of the first step (training.pace.Pace): it exists from the second.
    wait_for(lambda: TrainingJob.objects.filter(pk=pk, step__gte=2).exists(), 120, "the job to run", poll=0.1)
    running = client.fine_tuning.jobs.retrieve(job.id)
    assert running.status == "running" and running.estimated_finish >= running.created_at
    assert running.trained_tokens is None  # OpenAI's: known once the job ended
    # It stops before its next step: the answer, read back after the cancel is written, says running, or
    # cancelled where the worker's next step came first (a step of the tiny model takes milliseconds).
    assert client.fine_tuning.jobs.cancel(job.id).status in ("running", "cancelled")
    seen, job = wait_final(client, job.id)
    assert job.status == "cancelled" and job.fine_tuned_model is None
    row = TrainingJob.objects.get(pk=pk)
    assert row.step < row.total_steps and row.adapter_version_id is None
    # The rows go in the cancelling transaction (training.base.checkpoints_discard): a cancelled job
    # lists no checkpoint, even one that ran past its first checkpoint step.
    assert list(client.fine_tuning.jobs.checkpoints.list(job.id)) == []
    assert [key for key in get_storage().list("adapters") if key.endswith("manifest.json")] == [
        "adapters/alice-co/support-bot/1.0.0/manifest.json"]


# Issue 41: each adapter kind beyond plain LoRA, as a Loraplex extension among the method's
# hyperparameters (docs/adapter-kinds.md, docs/quantized-bases.md), with the adapter kind the registry records.
KINDS = {
    "dora-bot": ({"use_dora": True}, "dora"),
    "qlora-bot": ({"base_quantization": "int4"}, "lora"),
    "vocab-bot": ({"target_modules": ["q_proj", "v_proj", "embed_tokens", "lm_head"]}, "lora"),
}


def test_each_adapter_kind_trains_through_the_sdk_and_answers_chat(processes, tenant_a):
    client = processes(tenant_a.key)
    training = client.files.create(file=("train.jsonl", jsonl(chat_lines())), purpose="fine-tune")
    jobs = {suffix: client.fine_tuning.jobs.create(
        model=BASE_MODEL_NAME, training_file=training.id, suffix=suffix, seed=3,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, **extra}}})
        for suffix, (extra, _) in KINDS.items()}
    question, _ = QA[0]
    for suffix, created in jobs.items():
        seen, job = wait_final(client, created.id)
        assert job.status == "succeeded", (suffix, seen, job.error)
        assert job.fine_tuned_model == f"{suffix}@1.0.0"
        version = AdapterVersion.objects.get(adapter__tenant=tenant_a.tenant, adapter__name=suffix)
        assert version.kind == KINDS[suffix][1]
        reply = client.chat.completions.with_raw_response.create(
            model=job.fine_tuned_model, temperature=0, max_tokens=4,
            messages=[{"role": "user", "content": question}])
        assert reply.headers["x-loraplex-adapter-version"] == "1.0.0", suffix
        assert reply.parse().model == job.fine_tuned_model and reply.parse().usage.completion_tokens == 4
