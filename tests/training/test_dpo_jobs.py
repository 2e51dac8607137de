"""DPO jobs through OpenAI's SDK on real processes: a preference file → `method: {"type": "dpo"}` →
a Celery worker trains it → the gateway serves the adapter, which prefers what the file preferred.
A malformed preference line is a line error of the file; a DPO job whose worker is SIGKILLed
resumes from its checkpoint to the adapter bytes of an uninterrupted job."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from serving.registry.storage import get_storage
from training import datasets, selectors
from training.models import Checkpoint, Dataset, TrainingJob
from training.packing import layout, sequence_sums, target_logprobs
from training.preference import encode, iter_valid_pairs
from training_support import BASE_MODEL_NAME, QA, jsonl, sdk, wait_for
from test_dpo import preference_lines, raw
from test_openai_sdk_e2e import processes, wait_final  # noqa: F401 (processes is a fixture)

pytestmark = pytest.mark.django_db(transaction=True)

DPO = {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.5, "n_epochs": 10, "batch_size": 4,
                                                  "learning_rate_multiplier": 50, "lora_dropout": 0.0}}}


def preference_margin(model: torch.nn.Module, tokenizer) -> float:
    """Mean over the file's pairs of log p(preferred) − log p(non-preferred) under `model`."""
    pairs = [encode(example, tokenizer, 128) for example in iter_valid_pairs(raw(preference_lines()))]
    sequences = [pair.chosen for pair in pairs] + [pair.rejected for pair in pairs]
    rows = layout(sequences, pad_id=tokenizer.pad_token_id, device=torch.device("cpu"), packed=False, capacity=128)
    with torch.no_grad():
        logprobs, trained = target_logprobs(model(**rows.model_inputs()).logits, rows)
    sums = sequence_sums(logprobs * trained, rows, len(sequences))
    return float((sums[:len(pairs)] - sums[len(pairs):]).mean())


def test_a_dpo_job_trains_through_the_sdk_and_its_adapter_serves(processes, tenant_a, base_model_dir, tmp_path):
    client = processes(tenant_a.key)
    bad = preference_lines()[:3]
    bad[1] = {**bad[1], "preferred_output": "Rome."}
    rejected = client.files.create(file=("bad.jsonl", jsonl(bad)), purpose="fine-tune")
    wait_for(lambda: client.files.retrieve(rejected.id).status == "error", 120, "the bad file's validation")
    assert "line 2: invalid_preferred_output" in client.files.retrieve(rejected.id).status_details

    file = client.files.create(file=("prefs.jsonl", jsonl(preference_lines(2))), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=file.id, suffix="polite-bot", seed=4,
                                         method=DPO)
    assert job.method.type == "dpo" and job.method.dpo.hyperparameters.beta == 0.5
    seen, job = wait_final(client, job.id)
    assert job.status == "succeeded", (seen, job.error)
    assert job.fine_tuned_model == "polite-bot@1.0.0" and job.method.dpo.hyperparameters.n_epochs == 10
    assert TrainingJob.objects.get(pk=int(job.id.removeprefix("ftjob-"))).hyperparameters["method"] == "dpo"
    metrics = [event.data for event in client.fine_tuning.jobs.list_events(job.id, limit=100)
               if event.type == "metrics"][::-1]
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"] - 0.2 and "train_reward_accuracy" in metrics[-1]

    question, _ = QA[0]
    reply = client.chat.completions.with_raw_response.create(
        model=job.fine_tuned_model, temperature=0, max_tokens=8,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": question}])
    assert reply.headers["x-loraplex-adapter-version"] == "1.0.0" and reply.parse().choices[0].message.content

    local = tmp_path / "adapter"
    get_storage().download_prefix("adapters/alice-co/polite-bot/1.0.0", local)
    tokenizer = AutoTokenizer.from_pretrained(base_model_dir)
    base = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
    before = preference_margin(base, tokenizer)
    after = preference_margin(PeftModel.from_pretrained(base, local), tokenizer)
    assert after > before + 1.0, (before, after)


def test_a_killed_dpo_job_resumes_to_the_adapter_of_an_uninterrupted_one(platform, wsgi_app, tenant_a, start_worker):
    # 16 pairs in batches of 2: 8 steps an epoch, 16 in all. Killed after its step-3 checkpoint, the job
    # still has 13 steps to go, and the resumed run crosses an epoch's reshuffle.
    env = {"CELERY_VISIBILITY_TIMEOUT": 3, "TRAINING_LEASE_SECONDS": 2, "TRAINING_CHECKPOINT_EVERY_STEPS": 3,
           "TRAINING_LOG_EVERY_STEPS": 1}
    first = start_worker(**env)
    client = sdk(wsgi_app, tenant_a.key)
    file = client.files.create(file=("prefs.jsonl", jsonl(preference_lines(2))), purpose="fine-tune")
    wait_for(lambda: client.files.retrieve(file.id).status == "processed", 120, "validation")
    assert Dataset.objects.get(pk=int(file.id.removeprefix("file-"))).format == Dataset.Format.PREFERENCE
    method = {"type": "dpo", "dpo": {"hyperparameters": {**DPO["dpo"]["hyperparameters"], "n_epochs": 2,
                                                         "batch_size": 2, "lora_dropout": 0.1,
                                                         "gradient_accumulation_steps": 2, "packing": True}}}
    killed = client.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=file.id, suffix="killed-bot",
                                            seed=3, method=method)
    pk = int(killed.id.removeprefix("ftjob-"))
    wait_for(lambda: Checkpoint.objects.filter(job_id=pk).exists(), 120, "the first checkpoint", poll=0.05)
    first.kill()
    assert TrainingJob.objects.get(pk=pk).status == "running", "the job ended before the kill; make it longer"

    start_worker(**env)
    job = wait_for(lambda: (lambda row: row if row.is_final else None)(TrainingJob.objects.get(pk=pk)), 300,
                   "the resumed job")
    assert job.status == "succeeded", job.error_message
    assert job.attempts == 2 and job.events.filter(message__startswith="Resuming from the checkpoint of step").exists()

    straight = client.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=file.id, suffix="straight-bot",
                                              seed=3, method=method)
    straight_pk = int(straight.id.removeprefix("ftjob-"))
    done = wait_for(lambda: (lambda row: row if row.is_final else None)(TrainingJob.objects.get(pk=straight_pk)), 300,
                    "the uninterrupted job")
    assert done.status == "succeeded", done.error_message

    def adapter(name: str) -> bytes:
        return get_storage().get_bytes(f"adapters/alice-co/{name}/1.0.0/adapter_model.safetensors")

    assert adapter("killed-bot") == adapter("straight-bot")


def test_a_preference_files_preview_shows_each_conversation_with_its_preferred_reply(platform, wsgi_app, tenant_a):
    client = sdk(wsgi_app, tenant_a.key)
    file = client.files.create(file=("prefs.jsonl", jsonl(preference_lines())), purpose="fine-tune")
    dataset_id = int(file.id.removeprefix("file-"))
    datasets.dataset_validate(dataset_id=dataset_id)
    preview = selectors.dataset_preview(dataset=Dataset.objects.get(pk=dataset_id), limit=2)
    assert [[message["content"] for message in example.messages] for example in preview] == [
        ["Answer briefly.", QA[0][0], QA[0][1]], ["Answer briefly.", QA[1][0], QA[1][1]]]
