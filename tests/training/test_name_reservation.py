"""A job for a new adapter holds its name's room under the tier's max_adapters from its creation on.

So a job the registry could not take fails when it is created, not hours later when it publishes;
jobs for the same new name share its room (they publish successive versions of one adapter), and
the registry does not give that room to another adapter meanwhile. The races run on PostgreSQL
(real row locks on the tenant): one creation wins, the other gets the error naming the job that
holds the room, and nothing of it is left.
"""

from __future__ import annotations

import pytest

from serving.contracts.errors import LimitExceeded
from serving.registry import services as registry
from serving.registry.models import Adapter
from tenants.models import Tier
from tests.races import race, slow_saves
from training import jobs
from training.models import Dataset, TrainingEvent, TrainingJob

SMALL = {"n_epochs": 1, "batch_size": 4}


def ready_dataset(tenant, name: str = "t") -> Dataset:
    return Dataset.objects.create(tenant=tenant, filename=f"{name}.jsonl",
                                  storage_key=f"datasets/{tenant.slug}/{name}.jsonl", sha256="0" * 64, size_bytes=1,
                                  status=Dataset.Status.READY, format="chat", num_examples=8)


def room_for(tenant, adapters: int) -> None:
    """The tenant's tier allows `adapters` adapters and starts no job (no task is sent to a broker)."""
    Tier.objects.filter(pk=tenant.tier_id).update(max_adapters=adapters, max_concurrent_training_jobs=0)
    tenant.refresh_from_db()


def create(tenant, dataset: Dataset, adapter: str) -> TrainingJob:
    return jobs.training_job_create(tenant=tenant, training_file=dataset.pk, adapter=adapter, hyperparameters=SMALL)


@pytest.mark.django_db
def test_a_job_for_a_new_adapter_holds_its_room_until_it_ends(tenant_a, platform):
    tenant = tenant_a.tenant
    room_for(tenant, 2)
    registry.adapter_create(tenant=tenant, name="existing")
    dataset = ready_dataset(tenant)
    first = create(tenant, dataset, "new-bot")
    # The same new name shares the room its first job holds: the jobs publish successive versions.
    create(tenant, dataset, "new-bot")
    # An adapter that exists needs no room.
    create(tenant, dataset, "existing")

    with pytest.raises(LimitExceeded) as refused:
        create(tenant, dataset, "other-bot")
    assert refused.value.code == "max_adapters_reached" and refused.value.param == "adapter"
    assert f"'new-bot' (training job #{first.pk})" in refused.value.message
    with pytest.raises(LimitExceeded) as registry_refused:
        registry.adapter_create(tenant=tenant, name="other-bot")
    assert f"'new-bot' (training job #{first.pk})" in registry_refused.value.message
    assert TrainingJob.objects.count() == 3 and not Adapter.objects.filter(name="other-bot").exists()

    # The registry may create the held name itself: the jobs then publish into it.
    registry.adapter_create(tenant=tenant, name="new-bot")
    assert Adapter.objects.filter(tenant=tenant).count() == 2


@pytest.mark.django_db
def test_the_room_comes_back_when_the_jobs_holding_it_end_and_a_retry_needs_it_again(tenant_a, platform):
    tenant = tenant_a.tenant
    room_for(tenant, 1)
    dataset = ready_dataset(tenant)
    held = create(tenant, dataset, "new-bot")
    with pytest.raises(LimitExceeded):
        create(tenant, dataset, "other-bot")

    jobs.training_job_cancel(job=held)
    other = create(tenant, dataset, "other-bot")
    with pytest.raises(LimitExceeded) as refused:
        jobs.training_job_retry(job=held)
    assert f"'other-bot' (training job #{other.pk})" in refused.value.message
    held.refresh_from_db()
    assert held.status == TrainingJob.Status.CANCELLED


@pytest.fixture
def widened_window():
    with slow_saves(TrainingJob):
        yield


@pytest.mark.django_db(transaction=True)
@pytest.mark.postgresql
def test_two_jobs_racing_for_the_last_room_one_wins_the_other_is_refused_whole(tenant_a, platform, widened_window):
    tenant = tenant_a.tenant
    room_for(tenant, 1)
    # A dataset each: a job's creation locks its dataset, and only the tenant's lock may order them.
    left, right = ready_dataset(tenant, "left"), ready_dataset(tenant, "right")
    for round_ in range(3):
        results = race(lambda: create(tenant, left, f"left-{round_}"),
                       lambda: create(tenant, right, f"right-{round_}"))
        won = [item for item in results if isinstance(item, TrainingJob)]
        lost = [item for item in results if isinstance(item, LimitExceeded)]
        assert len(won) == 1 and len(lost) == 1, results
        assert f"'{won[0].adapter_name}' (training job #{won[0].pk})" in lost[0].message
        assert list(TrainingJob.objects.values_list("pk", flat=True)) == [won[0].pk]
        assert list(TrainingEvent.objects.values_list("job_id", flat=True)) == [won[0].pk]
        TrainingJob.objects.all().delete()


@pytest.mark.django_db(transaction=True)
@pytest.mark.postgresql
def test_a_job_and_the_registry_racing_for_the_last_room_one_wins(tenant_a, platform, widened_window):
    tenant = tenant_a.tenant
    room_for(tenant, 1)
    dataset = ready_dataset(tenant)
    job, adapter = race(lambda: create(tenant, dataset, "trained-bot"),
                        lambda: registry.adapter_create(tenant=tenant, name="made-bot"))
    if isinstance(job, TrainingJob):
        assert isinstance(adapter, LimitExceeded) and f"(training job #{job.pk})" in adapter.message
        assert not Adapter.objects.exists()
    else:
        assert isinstance(job, LimitExceeded) and isinstance(adapter, Adapter)
        assert not TrainingJob.objects.exists() and not TrainingEvent.objects.exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.postgresql
def test_two_jobs_racing_for_the_same_new_name_both_hold_its_one_room(tenant_a, platform, widened_window):
    tenant = tenant_a.tenant
    room_for(tenant, 1)
    left, right = ready_dataset(tenant, "left"), ready_dataset(tenant, "right")
    results = race(lambda: create(tenant, left, "shared-bot"), lambda: create(tenant, right, "shared-bot"))
    assert all(isinstance(item, TrainingJob) for item in results), results
    with pytest.raises(LimitExceeded):
        create(tenant, left, "other-bot")
