"""A job's page offers each kept checkpoint as a model: "Open in Playground" (the Playground opens on
it) and "Deploy as version" (a new version of the job's adapter, then its adapter's page); a
checkpoint of another tenant's job is out of reach."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import pytest
from django.urls import reverse

from serving.engine.tiny import build_tiny_model, save_random_peft_adapter
from serving.registry.models import AdapterVersion
from serving.registry.storage import get_storage
from training.models import Checkpoint, TrainingJob
from training.publishing import artifact_publish

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fast_passwords")]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("base") / "tiny-llama", arch="llama", size="tiny", seed=0)


@pytest.fixture
def job(tenant_a, settings, tmp_path, base_dir) -> TrainingJob:
    """A running job of alice-co with a checkpoint at step 4 (saved before artifacts: a resume point
    only) and one at step 8 whose artifact is stored as a run stores it."""
    settings.STORAGE_URL = f"file://{tmp_path / 'storage'}"
    settings.BASE_MODEL_PATH, settings.BASE_MODEL_NAME = base_dir, "tiny-llama"
    job = TrainingJob.objects.create(tenant=tenant_a.tenant, adapter_name="ckpt-bot", base_model="tiny-llama", seed=1,
                                     status=TrainingJob.Status.RUNNING, step=9, total_steps=20)
    Checkpoint.objects.create(job=job, step=4, storage_prefix="checkpoints/alice-co/1/step-00000004")
    checkpoint = Checkpoint(job=job, step=8, storage_prefix=f"checkpoints/alice-co/{job.pk}/step-00000008",
                            metrics={"step": 8, "train_loss": 1.25, "valid_loss": 1.5})
    adapter = save_random_peft_adapter(base_dir, tmp_path / "adapter", r=4, lora_alpha=8,
                                       target_modules=["q_proj", "v_proj"], seed=2)
    checkpoint.manifest_sha256 = artifact_publish(adapter, checkpoint.artifact_prefix, job=job,
                                                  version=f"ftjob-{job.pk}:ckpt-step-8")
    checkpoint.artifact_uri = get_storage().uri(checkpoint.artifact_prefix) + "/"
    checkpoint.save()
    return job


def test_the_job_page_opens_a_checkpoint_in_the_playground(as_user, people, job):
    model = f"ckpt-bot@ftjob-{job.pk}:ckpt-step-8"
    member = as_user(people.member)
    page = member.get(reverse("dashboard:job", args=[job.pk])).content.decode()
    link = f'{reverse("dashboard:playground")}?model={quote(model)}'
    assert f'href="{link}"' in page and 'data-checkpoint-deploy="8"' in page
    assert "1.5000" in page  # its valid loss
    assert 'data-checkpoint-playground="4"' not in page and "resume point only" in page

    playground = member.get(link)
    assert playground.context["left"] == model
    checkpoints = next(group for group in playground.context["groups"] if group["kind"] == "checkpoint")
    assert checkpoints["choices"] == [{"value": model, "label": f"{model} (job {job.pk}, step 8)"}]
    # A name the tenant cannot call is not preselected.
    assert member.get(reverse("dashboard:playground") + "?model=other@1.0.0").context["left"] != "other@1.0.0"
    # A viewer may open it, not deploy it.
    viewer_page = as_user(people.viewer).get(reverse("dashboard:job", args=[job.pk])).content.decode()
    assert f'href="{link}"' in viewer_page and 'data-checkpoint-deploy="8"' not in viewer_page


def test_deploy_as_version_makes_a_version_and_leads_to_its_adapter(as_user, people, job):
    member = as_user(people.member)
    url = reverse("dashboard:job-checkpoint-version", args=[job.pk, 8])
    response = member.post(url, {"reason": "looks good"})
    assert response.status_code == 302 and response["Location"] == reverse("dashboard:adapter", args=["ckpt-bot"])
    version = AdapterVersion.objects.get(adapter__tenant=job.tenant, adapter__name="ckpt-bot")
    assert (version.version, version.source_id, version.source_checkpoint_step) == ("1.0.0", str(job.pk), 8)
    assert "Version 1.0.0 of ckpt-bot is made from the checkpoint of step 8" in member.get(
        response["Location"]).content.decode()

    # A resume point only is refused by its reason, on the job's page; nothing is made.
    refused = member.post(reverse("dashboard:job-checkpoint-version", args=[job.pk, 4]), follow=True)
    assert "has no adapter artifact to deploy" in refused.content.decode()
    assert AdapterVersion.objects.count() == 1
    # A viewer may not; bob finds no such job.
    assert as_user(people.viewer).post(url).status_code == 403
    assert as_user(people.bob).post(url).status_code == 404
    assert AdapterVersion.objects.count() == 1
