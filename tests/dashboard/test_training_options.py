"""The dashboard's new-job form takes the trainer's options and DPO (issue 25, items 3 and 4): the
method, the schedule, packing and gradient checkpointing, accumulation, weight decay, beta and the
adapter kind (use_dora, issue 41) reach the job; a DPO job on a chat file is refused with the form kept."""

from __future__ import annotations

import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from training import datasets
from training.models import Dataset, TrainingJob

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fast_passwords")]

CHAT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
PAIR = {"input": {"messages": [{"role": "user", "content": "Hi"}]},
        "preferred_output": [{"role": "assistant", "content": "Hello!"}],
        "non_preferred_output": [{"role": "assistant", "content": "Go away."}]}


@pytest.fixture(autouse=True)
def storage(settings, tmp_path):
    settings.STORAGE_URL = f"file://{tmp_path / 'storage'}"
    settings.S3_ENDPOINT_URL = None
    settings.BASE_MODEL_PATH = tmp_path / "no-model"  # no tokenizer: token statistics are skipped


def ready(tenant, line: dict) -> Dataset:
    content = (json.dumps(line) + "\n").encode() * 12
    created = datasets.dataset_create(tenant=tenant, source=SimpleUploadedFile("data.jsonl", content),
                                      filename="data.jsonl", size=len(content))
    dataset = datasets.dataset_validate(dataset_id=created.pk)
    assert dataset.status == "ready", dataset.report
    return dataset


def test_the_form_sends_dpo_and_the_trainers_options(as_user, people, tenant_a):
    chat, pairs = ready(tenant_a.tenant, CHAT), ready(tenant_a.tenant, PAIR)
    client = as_user(people.member)
    page = client.get(reverse("dashboard:job-new")).content
    assert b'<option value="dpo"' in page and b'name="packing"' in page and b'id="hp-beta"' in page
    form = {"training_file": str(chat.pk), "adapter": "prefs", "method": "dpo", "beta": "0.3",
            "lr_scheduler_type": "cosine", "packing": "on", "gradient_checkpointing": "on",
            "gradient_accumulation_steps": "2", "weight_decay": "0.01", "use_dora": "on"}
    refused = client.post(reverse("dashboard:job-create"), form)
    assert refused.status_code == 400 and b"A DPO job trains on a preference file" in refused.content
    assert b'<option value="dpo" selected' in refused.content and b'name="packing" checked' in refused.content
    created = client.post(reverse("dashboard:job-create"), {**form, "training_file": str(pairs.pk)})
    job = TrainingJob.objects.get()
    assert created["Location"] == reverse("dashboard:job", args=[job.pk])
    hp = job.hyperparameters
    assert (hp["method"], hp["beta"], hp["lr_scheduler_type"]) == ("dpo", 0.3, "cosine")
    assert (hp["packing"], hp["gradient_checkpointing"], hp["gradient_accumulation_steps"], hp["weight_decay"]) == (
        True, True, 2, 0.01)
    assert hp["use_dora"] is True  # the adapter kind (docs/adapter-kinds.md)
    assert b"<dt>Method</dt><dd>DPO, \xce\xb2 0.3</dd>" in client.get(created["Location"]).content


def test_the_form_sends_qlora_and_the_vocabulary_modules(as_user, people, tenant_a, settings, tmp_path):
    """Issue 41: the base's precision (QLoRA's int4) and LoRA on embed_tokens / lm_head from the form;
    "all-linear" ticked beside a vocabulary module names the base's projections one by one. On a base
    that ties lm_head to embed_tokens the vocabulary modules are not offered (the engine would refuse)."""
    chat = ready(tenant_a.tenant, CHAT)
    client = as_user(people.member)
    page = client.get(reverse("dashboard:job-new")).content
    assert b'<option value="int4"' in page and b'value="lm_head"' in page and b'value="embed_tokens"' in page
    client.post(reverse("dashboard:job-create"), {
        "training_file": str(chat.pk), "adapter": "vocab", "base_quantization": "int4",
        "target_modules": ["all-linear", "lm_head"]})
    job = TrainingJob.objects.get()
    assert job.hyperparameters["base_quantization"] == "int4"
    assert job.hyperparameters["target_modules"][-1] == "lm_head" and "q_proj" in job.hyperparameters["target_modules"]
    assert b"over the INT4 base (QLoRA)" in client.get(reverse("dashboard:job", args=[job.pk])).content

    tied = tmp_path / "tied"
    tied.mkdir()
    (tied / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    settings.BASE_MODEL_PATH = tied
    page = client.get(reverse("dashboard:job-new")).content
    assert b'value="lm_head"' not in page and b'value="embed_tokens"' not in page
