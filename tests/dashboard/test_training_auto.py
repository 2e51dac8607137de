"""The new-job form's empty n_epochs, batch_size and learning_rate are "auto" (issue 39): the job
gets what the API stores for "auto" on the same dataset (picked from its size), an explicit value is
kept, and the job page shows the values picked, or "auto" while an API job's files still wait to be
validated (updated by the page's poll)."""

from __future__ import annotations

import json
import re

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from training import datasets
from training.hyperparameters import Hyperparameters
from training.models import Dataset, TrainingJob

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fast_passwords")]

AUTO = {"n_epochs": "auto", "batch_size": "auto", "learning_rate": "auto"}
# 12 examples: few enough that "auto" differs from every default (more epochs, a higher rate).
EXAMPLES = 12


@pytest.fixture(autouse=True)
def storage(settings, tmp_path):
    settings.STORAGE_URL = f"file://{tmp_path / 'storage'}"
    settings.S3_ENDPOINT_URL = None
    settings.BASE_MODEL_PATH = tmp_path / "no-model"  # no tokenizer: token statistics are skipped


@pytest.fixture
def dataset(tenant_a) -> Dataset:
    content = b"".join(json.dumps({"messages": [{"role": "user", "content": f"Question {n}?"},
                                                {"role": "assistant", "content": f"Answer {n}."}]}).encode() + b"\n"
                       for n in range(EXAMPLES))
    created = datasets.dataset_create(tenant=tenant_a.tenant, source=SimpleUploadedFile("data.jsonl", content),
                                      filename="data.jsonl", size=len(content))
    ready = datasets.dataset_validate(dataset_id=created.pk)
    assert ready.status == "ready" and ready.num_examples == EXAMPLES, ready.report
    return ready


def field(page: str, name: str) -> str:
    """The <input> tag of hyperparameter `name` on the form."""
    return re.search(rf'<input id="hp-{name}"[^>]*>', page).group(0)


def settings_shown(page: str) -> dict[str, str]:
    return {name: re.search(rf'<dd id="job-{name}">([^<]*)</dd>', page).group(1)
            for name in ("epochs", "batch-size", "learning-rate")}


def test_empty_fields_are_auto_exactly_as_the_apis_auto(as_user, people, client_a, dataset):
    client = as_user(people.member)
    form_page = client.get(reverse("dashboard:job-new")).content.decode()
    for name in AUTO:
        assert 'placeholder="auto"' in field(form_page, name)
    assert 'placeholder="8"' in field(form_page, "r")  # the others still show their default

    created = client.post(reverse("dashboard:job-create"), {"training_file": str(dataset.pk), "adapter": "form-bot"})
    assert created.status_code == 302, created.content
    from_form = TrainingJob.objects.get(adapter_name="form-bot")
    response = client_a.post("/api/v1/training-jobs", {"training_file": dataset.pk, "adapter": "api-bot",
                                                       "hyperparameters": AUTO}, format="json")
    assert response.status_code == 201, response.json()
    from_api = TrainingJob.objects.get(adapter_name="api-bot")

    assert from_form.hyperparameters == from_api.hyperparameters
    assert from_form.total_steps == from_api.total_steps
    hp = from_form.hyperparameters
    # Picked from the dataset's size, not the defaults an omitted value takes.
    assert hp["auto"] == [] and hp["n_epochs"] != Hyperparameters.n_epochs
    assert hp["learning_rate"] != Hyperparameters.learning_rate
    # The form's estimate counts the epochs "auto" picks for that dataset.
    assert f'data-auto-epochs="{hp["n_epochs"]}"' in form_page

    shown = settings_shown(client.get(created["Location"]).content.decode())
    assert shown == {"epochs": str(hp["n_epochs"]), "batch-size": str(hp["batch_size"]),
                     "learning-rate": f'{hp["learning_rate"]:.3g}'}


def test_explicit_values_are_kept(as_user, people, dataset):
    client = as_user(people.member)
    created = client.post(reverse("dashboard:job-create"), {
        "training_file": str(dataset.pk), "adapter": "form-bot", "n_epochs": "2", "batch_size": "3",
        "learning_rate": "0.0005"})
    assert created.status_code == 302, created.content
    hp = TrainingJob.objects.get().hyperparameters
    assert (hp["n_epochs"], hp["batch_size"], hp["learning_rate"], hp["auto"]) == (2, 3, 0.0005, [])
    assert settings_shown(client.get(created["Location"]).content.decode()) == {
        "epochs": "2", "batch-size": "3", "learning-rate": "0.0005"}


def test_the_page_shows_auto_until_the_values_are_picked_and_its_poll_brings_them(as_user, people, tenant_a,
                                                                                    dataset):
    client = as_user(people.member)
    waiting = {**Hyperparameters(auto=list(AUTO)).to_dict()}
    job = TrainingJob.objects.create(tenant=tenant_a.tenant, dataset=dataset, adapter_name="bot", base_model="tiny",
                                     hyperparameters=waiting, seed=1)
    page = reverse("dashboard:job", args=[job.pk])
    shown = client.get(page).content.decode()
    assert settings_shown(shown) == {"epochs": "auto", "batch-size": "auto", "learning-rate": "auto"}
    assert "The job's settings." not in shown  # the template's comment stays a comment
    TrainingJob.objects.filter(pk=job.pk).update(hyperparameters={**waiting, "auto": [], "n_epochs": 8,
                                                                  "learning_rate": 0.002})
    polled = client.get(page, HTTP_HX_REQUEST="true").content.decode()
    assert '<dl class="facts" id="job-settings" hx-swap-oob="true">' in polled
    assert settings_shown(polled) == {"epochs": "8", "batch-size": "4", "learning-rate": "0.002"}
    # Nothing but the two elements: stray text would pile up beside the progress at every poll.
    assert "The job's settings." not in polled
    assert "hx-swap-oob" not in client.get(page).content.decode()  # the full page has the one, plain
