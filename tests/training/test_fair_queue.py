"""Celery work comes in turns between tenants (issue 37, item 5). Training jobs (training.concurrency):
the next job is chosen when a worker takes one, round robin between the tenants waiting (fewest
running first), oldest first within a tenant, never more than TRAINING_DISPATCH_AHEAD tasks untaken
on the queue; the worker is played by the test (a claim is what a worker does when it takes a job's
task). Validations (training.datasets): one file of a tenant at a time on the quick queue."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from tenants.models import Tenant, Tier
from tenants.services import tenant_create
from training import concurrency, datasets, dispatch, jobs, run, sweep
from training.models import Dataset, TrainingJob
from training_support import chat_lines, jsonl

pytestmark = pytest.mark.django_db

HP = {"n_epochs": 1, "batch_size": 4, "learning_rate": 1e-2, "r": 4}


def ready_dataset(tenant: Tenant) -> Dataset:
    created = datasets.dataset_create(tenant=tenant, source=jsonl(chat_lines(1)), filename="t.jsonl")
    dataset = datasets.dataset_validate(dataset_id=created.pk)
    assert dataset.status == Dataset.Status.READY
    return dataset


def queue(tenant: Tenant, dataset: Dataset, count: int) -> list[int]:
    """`count` jobs of the tenant, each created as the API creates it (its dispatch included)."""
    created = []
    for _ in range(count):
        job = jobs.training_job_create(tenant=tenant, training_file=dataset.pk, adapter="bot", hyperparameters=HP,
                                       seed=1)
        concurrency.training_jobs_dispatch()  # what the creation's commit runs
        created.append(job.pk)
    return created


def take_next() -> int:
    """A worker takes the one task on the queue (its claim), and the claim's commit sends the next."""
    waiting = list(TrainingJob.objects.filter(status=TrainingJob.Status.QUEUED, dispatched_at__isnull=False)
                   .values_list("pk", flat=True))
    assert len(waiting) == 1, f"{len(waiting)} tasks on the queue, not one"
    assert run.training_job_claim(job_id=waiting[0]).token
    concurrency.training_jobs_dispatch()
    return waiting[0]


@pytest.fixture
def three_tenants(platform, tenant_a, tenant_b) -> list[tuple[Tenant, Dataset]]:
    Tier.objects.update(max_concurrent_training_jobs=5)  # the tenants' own limits are not what is tested
    carol, _ = tenant_create(slug="carol-co", tier_name="standard", name="Carol")
    tenants = [Tenant.objects.get(pk=tenant_a.tenant.pk), Tenant.objects.get(pk=tenant_b.tenant.pk), carol]
    return [(tenant, ready_dataset(tenant)) for tenant in tenants]


def test_jobs_start_round_robin_between_tenants_not_in_the_order_they_were_queued(three_tenants):
    (alice, alice_data), (bob, bob_data), (carol, carol_data) = three_tenants
    a1, a2, a3 = queue(alice, alice_data, 3)
    b1, b2 = queue(bob, bob_data, 2)
    (c1,) = queue(carol, carol_data, 1)
    # Global first-in first-out would start a1, a2, a3, b1, b2, c1: bob and carol behind all of alice's.
    started = [take_next() for _ in range(6)]
    assert started == [a1, b1, c1, a2, b2, a3]
    assert concurrency.training_jobs_dispatch() == []


def test_a_tenant_that_queued_first_and_most_waits_for_its_turn_after_a_newcomer(three_tenants):
    (alice, alice_data), (bob, bob_data), _ = three_tenants
    a1, a2, a3 = queue(alice, alice_data, 3)
    assert take_next() == a1
    # bob queues while alice's second job is already on the queue (chosen when a1 was taken): his
    # job is the next chosen after that, not after alice's third.
    (b1,) = queue(bob, bob_data, 1)
    assert take_next() == a2
    assert take_next() == b1
    assert take_next() == a3


def test_one_task_waits_on_the_queue_and_each_tenants_limit_still_holds(three_tenants, settings):
    (alice, alice_data), (bob, bob_data), _ = three_tenants
    Tier.objects.filter(pk=alice.tier_id).update(max_concurrent_training_jobs=1)
    a1, a2 = queue(alice, alice_data, 2)
    (b1,) = queue(bob, bob_data, 1)
    # One task untaken at a time: choosing b1 or a2 now would be choosing before a worker needs one.
    assert list(TrainingJob.objects.filter(dispatched_at__isnull=False).values_list("pk", flat=True)) == [a1]
    assert sweep.training_jobs_sweep()["dispatched"] == []
    assert take_next() == a1
    assert take_next() == b1  # a2 waits: alice's one slot is a1's
    assert concurrency.training_jobs_dispatch() == []
    # More ahead, when the operator asks for it; still within alice's limit.
    settings.TRAINING_DISPATCH_AHEAD = 3
    assert concurrency.training_jobs_dispatch() == []
    TrainingJob.objects.filter(pk=a1).update(status=TrainingJob.Status.SUCCEEDED)  # its run ended
    assert concurrency.training_jobs_dispatch() == [a2]


def test_a_tenants_files_are_validated_one_at_a_time_so_another_tenants_file_goes_at_once(
        platform, tenant_a, tenant_b, monkeypatch, django_capture_on_commit_callbacks):
    """Ten large files of one tenant used to fill the quick queue ahead of another tenant's small one;
    now a tenant has one file on the queue or being checked, and its next goes when that one ends."""
    sent: list[int] = []
    monkeypatch.setattr(dispatch, "task_send", lambda name, dataset_id: sent.append(dataset_id))

    def upload(tenant: Tenant, name: str) -> int:
        with django_capture_on_commit_callbacks(execute=True):  # the upload's commit sends its task
            return datasets.dataset_create(tenant=tenant, source=jsonl(chat_lines(1)), filename=name).pk

    a1, a2, a3 = (upload(tenant_a.tenant, f"a{index}.jsonl") for index in range(3))
    b1 = upload(tenant_b.tenant, "b.jsonl")
    assert sent == [a1, b1]

    # The sweep's minute does not send a file whose tenant has one in flight.
    Dataset.objects.filter(pk__in=[a2, a3]).update(created_at=timezone.now() - timedelta(minutes=2))
    with django_capture_on_commit_callbacks(execute=True):
        sweep.training_jobs_sweep()
    assert sent == [a1, b1]

    with django_capture_on_commit_callbacks(execute=True):
        assert datasets.dataset_validate(dataset_id=a1).status == Dataset.Status.READY
    assert sent == [a1, b1, a2]
    # A file deleted while its validation is on the queue passes the turn on.
    with django_capture_on_commit_callbacks(execute=True):
        datasets.dataset_delete(dataset=Dataset.objects.get(pk=a2))
    assert sent == [a1, b1, a2, a3]
