"""Issue 37, item 5, on real workers: with `make up`'s two Celery workers (their queues and
concurrency read from the launcher), another tenant's dataset is validated while a training job
runs. With the one worker of before (both queues, concurrency 1) it waited for the job's end."""

from __future__ import annotations

import pytest

from lora_platform import launcher
from training import datasets, jobs
from training.models import Dataset, TrainingJob
from training_support import chat_lines, jsonl, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def launcher_queues(child: str) -> list[str]:
    """The queue and concurrency options of one of the launcher's Celery workers."""
    argv = next(spec.argv for spec in launcher.child_processes() if spec.name == child)
    options = []
    for name in ("--queues", "--concurrency"):
        options += [name, argv[argv.index(name) + 1]]
    return options


def test_a_tenants_validation_is_not_held_behind_another_tenants_training_job(platform, tenant_a, tenant_b,
                                                                               start_worker):
    start_worker(queues=launcher_queues("training-worker"), TRAINING_LOG_EVERY_STEPS=1)
    start_worker(queues=launcher_queues("worker"))
    first = datasets.dataset_create(tenant=tenant_a.tenant, source=jsonl(chat_lines(4)), filename="a.jsonl")
    wait_for(lambda: Dataset.objects.get(pk=first.pk).status == Dataset.Status.READY, 120, "tenant A's dataset")
    job = jobs.training_job_create(tenant=tenant_a.tenant, training_file=first.pk, adapter="long", seed=1,
                                   hyperparameters={"n_epochs": 50, "batch_size": 1, "learning_rate": 1e-3})
    wait_for(lambda: TrainingJob.objects.filter(pk=job.pk, step__gte=1).exists(), 180, "the job to run", poll=0.1)

    small = datasets.dataset_create(tenant=tenant_b.tenant, source=jsonl(chat_lines(1)), filename="b.jsonl")
    # Polled against the job's state, not a clock: B's file must be checked while A's job still runs.
    def checked_or_job_over() -> bool:
        return (Dataset.objects.get(pk=small.pk).status in (Dataset.Status.READY, Dataset.Status.INVALID)
                or TrainingJob.objects.get(pk=job.pk).is_final)

    wait_for(checked_or_job_over, 600, "tenant B's validation or the end of A's job")
    assert Dataset.objects.get(pk=small.pk).status == Dataset.Status.READY
    assert TrainingJob.objects.get(pk=job.pk).status == TrainingJob.Status.RUNNING, "B's file waited for A's job"

    jobs.training_job_cancel(job=TrainingJob.objects.get(pk=job.pk))
    wait_for(lambda: TrainingJob.objects.get(pk=job.pk).is_final, 120, "the cancelled job to end")
