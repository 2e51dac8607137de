"""Training concurrency: which waiting job starts next, fairly between tenants, within their limits.

A tenant's tier allows `max_concurrent_training_jobs`; a job counts toward that limit from the moment
its task is sent (`dispatched_at`) until it ends. The training queue is kept short, so the choice of
the next job is made when a worker is about to need one, not when a job was created: at most
TRAINING_DISPATCH_AHEAD tasks (default 1) wait on the queue untaken, and each time a worker takes
one (its claim, training.run) the next job is chosen and sent. The choice, platform-wide:

1. the tenants with a waiting job (files validated) and room under their own limit;
2. of those, the one with the fewest jobs holding a slot (running or sent), then the one served
   longest ago (its latest task sent; never served first): round robin between tenants;
3. that tenant's oldest waiting job.

So a tenant that queued ten jobs gets one turn in each round, not the next ten starts: with one
training worker, another tenant's job starts after at most the job running now and the one already
sent (docs/training.md, "Queueing"). `training_jobs_dispatch` runs when a job is created, released
by its files' validation, cancelled, paused, resumed or retried, when a worker takes a job and when a
run ends, and from the periodic sweep (training.sweep).
"""

from __future__ import annotations

from datetime import datetime, timezone as dt_timezone
from functools import partial

from django.db import transaction
from django.db.models import Count, Max, Min, Q
from django.utils import timezone

from tenants.models import Tenant
from training import conf, dispatch
from training.base import PENDING_DATASET_STATUSES, Status, after_commit, event
from training.models import Dataset, TrainingJob


# The last service of a tenant never served: before any other.
NEVER = datetime.min.replace(tzinfo=dt_timezone.utc)


def counts_toward_limit() -> Q:
    """The jobs that count toward their tenant's concurrent-job limit: running, or queued with their task sent."""
    return Q(status=Status.RUNNING) | Q(status=Status.QUEUED, dispatched_at__isnull=False)


def _waiting() -> Q:
    """Jobs that may start: queued, no task sent, their files validated (training.jobs.training_jobs_release)."""
    return (Q(status=Status.QUEUED, dispatched_at__isnull=True, dataset__status=Dataset.Status.READY)
            & ~Q(validation_dataset__status__in=PENDING_DATASET_STATUSES))


def training_jobs_dispatch() -> list[int]:
    """Sends the tasks of the next jobs, chosen fairly between tenants (the module's rule); their ids."""
    sent: list[int] = []
    # Each job once a call: one whose task could not be sent (the broker is down) waits again, for the sweep.
    while (job_id := _dispatch_next(excluded=sent)) is not None:
        sent.append(job_id)
    return sent


def _dispatch_next(*, excluded: list[int]) -> int | None:
    """Sends the task of the one job whose turn it is, if the queue has room for one; its id."""
    with transaction.atomic():
        waiting = TrainingJob.objects.filter(_waiting()).exclude(pk__in=excluded)
        oldest_waiting = dict(waiting.order_by().values("tenant_id").annotate(oldest=Min("pk"))
                              .values_list("tenant_id", "oldest"))
        if not oldest_waiting:
            return None
        # Every candidate's row, in one order: dispatchers that may choose the same tenants take turns (on
        # PostgreSQL; SQLite has one writer), and each counts the queue and the limits after the last one.
        tenants = list(Tenant.objects.select_for_update(of=("self",)).select_related("tier")
                       .filter(pk__in=oldest_waiting).order_by("pk"))
        ahead = TrainingJob.objects.filter(status=Status.QUEUED, dispatched_at__isnull=False).count()
        if ahead >= conf.setting_int("TRAINING_DISPATCH_AHEAD"):
            return None
        served = {row["tenant_id"]: row for row in TrainingJob.objects.filter(tenant_id__in=oldest_waiting)
                  .order_by().values("tenant_id").annotate(holding=Count("pk", filter=counts_toward_limit()),
                                                last=Max("dispatched_at"))}

        def turn(tenant: Tenant) -> tuple[int, datetime, int]:
            # Fewest slots held, then served longest ago (never: first), then the oldest waiting job.
            return served[tenant.pk]["holding"], served[tenant.pk]["last"] or NEVER, oldest_waiting[tenant.pk]

        for tenant in sorted(tenants, key=turn):
            if served[tenant.pk]["holding"] >= tenant.tier.max_concurrent_training_jobs:
                continue
            # Read again under the lock: another dispatcher may have sent the job read above.
            job = waiting.filter(tenant=tenant).order_by("id").first()
            if job is None:
                continue
            job.dispatched_at = timezone.now()
            job.save(update_fields=["dispatched_at"])
            event(job, "The job's turn has come (its tenant's limit has room); it is waiting for a worker.")
            after_commit(partial(run_send, job.pk))
            return job.pk
    return None


def run_send(job_id: int) -> None:
    """Sends the job's run task (once its turn came, or again from the sweep)."""
    try:
        dispatch.task_send(dispatch.RUN_JOB, job_id)
    except Exception:
        # Not sent (the broker is down): a queued job stops counting toward the limit and waits again, so
        # the sweep's next dispatch sends it once the broker is back, instead of it holding a place forever.
        TrainingJob.objects.filter(pk=job_id, status=Status.QUEUED, lease_token="").update(dispatched_at=None)
        raise
