"""Training concurrency: which waiting jobs start, within each tenant's concurrent-job limit.

A tenant's tier allows `max_concurrent_training_jobs`; a job counts toward that limit from the moment
its task is sent (`dispatched_at`) until it ends. `training_jobs_dispatch` starts the oldest waiting
jobs the limit has room for under the tenant's row lock; it runs when a job is created, when a job ends (the
finishing run calls it) and from the periodic sweep (training.sweep).
"""

from __future__ import annotations

from functools import partial

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from tenants.models import Tenant
from training import dispatch
from training.base import PENDING_DATASET_STATUSES, Status, after_commit, event
from training.models import Dataset, TrainingJob


def counts_toward_limit() -> Q:
    """The jobs that count toward their tenant's concurrent-job limit: running, or queued with their task sent."""
    return Q(status=Status.RUNNING) | Q(status=Status.QUEUED, dispatched_at__isnull=False)


def training_jobs_dispatch(*, tenant_id: int) -> list[int]:
    """Sends the tasks of the tenant's oldest waiting jobs that its concurrent-job limit has room for; their ids."""
    with transaction.atomic():
        tenant = Tenant.objects.select_for_update(of=("self",)).select_related("tier").filter(pk=tenant_id).first()
        if tenant is None:
            return []
        jobs = TrainingJob.objects.for_tenant(tenant)
        free = tenant.tier.max_concurrent_training_jobs - jobs.filter(counts_toward_limit()).count()
        if free <= 0:
            return []
        # A job whose files are still being validated waits for them (training.jobs.training_jobs_release).
        waiting = list(jobs.filter(status=Status.QUEUED, dispatched_at__isnull=True,
                                   dataset__status=Dataset.Status.READY)
                       .exclude(validation_dataset__status__in=PENDING_DATASET_STATUSES).order_by("id")[:free])
        now = timezone.now()
        for job in waiting:
            job.dispatched_at = now
            job.save(update_fields=["dispatched_at"])
            event(job, "The tenant's concurrent-job limit has room; the job is waiting for a worker.")
            after_commit(partial(run_send, job.pk))
    return [job.pk for job in waiting]


def run_send(job_id: int) -> None:
    """Sends the job's run task (once the limit had room for it, or again from the sweep)."""
    try:
        dispatch.task_send(dispatch.RUN_JOB, job_id)
    except Exception:
        # Not sent (the broker is down): a queued job stops counting toward the limit and waits again, so
        # the sweep's next dispatch sends it once the broker is back, instead of it holding a place forever.
        TrainingJob.objects.filter(pk=job_id, status=Status.QUEUED, lease_token="").update(dispatched_at=None)
        raise
