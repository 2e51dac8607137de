"""Every kept checkpoint is a model, end to end with the official `openai` SDK: a web process (the
gateway and /v1/fine_tuning), a Celery worker and a serving worker (test_openai_sdk_e2e.py's).

A job keeps two checkpoints; `checkpoints.list` gives them with their metrics and OpenAI's names; a
chat to a checkpoint's name (OpenAI's and our pinned form) answers with exactly the greedy tokens of
the engine with that checkpoint's artifact loaded directly; a checkpoint retention deleted and
another tenant's are the same 404 as a name that never was.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from serving.engine import LLM, LoRARequest, SamplingParams
from serving.registry.storage import get_storage
from tests.training.test_openai_sdk_e2e import processes, wait_final  # noqa: F401 (the fixture, reused)
from training.models import Checkpoint
from training_support import BASE_MODEL_NAME, QA, chat_lines, jsonl

pytestmark = pytest.mark.django_db(transaction=True)

MAX_TOKENS = 8
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QA[0][0]}]


def greedy(client: openai.OpenAI, model: str) -> tuple[list[int], str]:
    """The gateway's greedy reply to MESSAGES: its token ids and the version header."""
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS, extra_body={"return_token_ids": True})
    reply = raw.parse()
    assert reply.model == model
    return reply.choices[0].token_ids, raw.headers["x-loraplex-adapter-version"]


def test_a_jobs_checkpoints_are_listed_and_called_as_models(processes, tenant_a, tenant_b, base_model_dir: Path,
                                                             tmp_path: Path):
    client = processes(tenant_a.key)
    training = client.files.create(file=("train.jsonl", jsonl(chat_lines(repeat=2))), purpose="fine-tune")
    validation = client.files.create(file=("valid.jsonl", jsonl(chat_lines(repeat=1))), purpose="fine-tune")
    # 16 examples in batches of 4 for 8 epochs: 32 steps, a checkpoint every 8 (8, 16, 24); two are kept.
    job = client.fine_tuning.jobs.create(
        model=BASE_MODEL_NAME, training_file=training.id, validation_file=validation.id, suffix="ckpt-bot", seed=7,
        hyperparameters={"n_epochs": 8, "batch_size": 4, "learning_rate_multiplier": 50})
    seen, job = wait_final(client, job.id)
    assert job.status == "succeeded", (seen, job.error)

    checkpoints = list(client.fine_tuning.jobs.checkpoints.list(job.id))
    assert [item.step_number for item in checkpoints] == [24, 16]
    for item in checkpoints:
        assert item.object == "fine_tuning.job.checkpoint" and item.fine_tuning_job_id == job.id
        assert item.fine_tuned_model_checkpoint == (
            f"ft:{BASE_MODEL_NAME}:alice-co:ckpt-bot:{job.id}:ckpt-step-{item.step_number}")
        assert item.metrics.step == item.step_number
        assert item.metrics.train_loss > 0 and item.metrics.valid_loss > 0

    # The engine itself, with the checkpoint's artifact (from storage, as stored) loaded directly.
    pk = int(job.id.removeprefix("ftjob-"))
    stored = Checkpoint.objects.get(job_id=pk, step=16)
    artifact = tmp_path / "checkpoint-16"
    get_storage().download_prefix(stored.artifact_prefix, artifact)
    engine = LLM(str(base_model_dir), max_loras=2, max_lora_rank=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = engine.chat(MESSAGES, params, LoRARequest("checkpoint-16", str(artifact)))[0].outputs[0].token_ids
    base = engine.chat(MESSAGES, params)[0].outputs[0].token_ids
    assert expected != base  # serving the base (or another adapter) instead could not go unnoticed

    label = f"{job.id}:ckpt-step-16"
    assert greedy(client, checkpoints[1].fine_tuned_model_checkpoint) == (expected, label)
    assert greedy(client, f"ckpt-bot@{label}") == (expected, label)
    assert client.models.retrieve(f"ckpt-bot@{label}").root == f"ckpt-bot@{label}"

    # Step 8 went to retention; bob's key finds none of alice's, under either tenant's name.
    other = processes(tenant_b.key)
    refused = [(client, f"ft:{BASE_MODEL_NAME}:alice-co:ckpt-bot:{job.id}:ckpt-step-8"),
               (other, checkpoints[1].fine_tuned_model_checkpoint),
               (other, f"ft:{BASE_MODEL_NAME}:bob-co:ckpt-bot:{job.id}:ckpt-step-16"),
               (other, f"ckpt-bot@{label}")]
    for caller, model in refused:
        with pytest.raises(openai.NotFoundError) as raised:
            caller.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
        assert raised.value.body["code"] == "model_not_found", model
