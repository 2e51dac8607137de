"""What every part of the training pipeline shares: after-commit sends, job events and endings, the lease.

The pipeline is split by job (datasets, jobs, concurrency, sweep, run, publishing, scratch); each part
ends jobs, writes their events and sends tasks after its commit the same way, so those pieces live
here and the parts import them from here rather than from each other.

Broker outages. Tasks are sent after the commit that needs them (`after_commit`); a send that
fails is logged and never fails the request nor undoes what it committed: an unsent validation is
sent by the sweep, and a job whose task was not sent stops counting toward the limit and is dispatched again.

Locks. Concurrency and versions are decided under the tenant's row lock, a job's state under its own.
A lock taken through a join names `of=("self",)`: PostgreSQL would otherwise lock the joined rows
too (a tenant's tier), serialising every tenant of that tier.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from django.db import transaction
from django.utils import timezone

from serving.contracts.errors import ServiceError
from serving.registry.storage import get_storage
from training import conf
from training.models import Checkpoint, Dataset, TrainingEvent, TrainingJob

logger = logging.getLogger(__name__)

Status = TrainingJob.Status
# A dataset in these is still being validated: no job trains on it yet.
PENDING_DATASET_STATUSES = (Dataset.Status.UPLOADED, Dataset.Status.VALIDATING)
# A job in one of these no longer holds the version it was to publish: another job or a checkpoint may take it.
VERSION_RELEASED_STATUSES = (Status.FAILED, Status.CANCELLED)


def after_commit(action: Callable[[], object]) -> None:
    """Runs `action` once the transaction commits. A failure (say, the broker is down) is logged and
    never undoes the committed change; the periodic sweep re-sends a task that was not sent.

    The action's errors are caught here rather than by `on_commit(..., robust=True)`: Django's
    robust path names the failed callable by `__qualname__`, which a functools.partial lacks, so its
    own AttributeError escaped into the caller (a 500 for a committed upload, whose file the
    caller's clean-up then deleted).
    """

    def run() -> None:
        try:
            action()
        except Exception:
            logger.exception("After-commit action %r failed; the periodic sweep repairs what it left undone",
                             action)

    transaction.on_commit(run)


class JobFailure(ServiceError):
    """Training cannot go on for a reason the tenant can act on; the job fails with this message."""


class LeaseLost(Exception):
    """Another delivery took the job over (this run's heartbeat was too old); stop without writing."""


def event(job: TrainingJob, message: str, *, level: str = TrainingEvent.Level.INFO,
          type: str = TrainingEvent.Type.MESSAGE, data: dict[str, Any] | None = None) -> TrainingEvent:
    """Adds a line to the job's log."""
    return TrainingEvent.objects.create(job=job, level=level, type=type, message=message, data=data or {})


def finish(job: TrainingJob, status: str, message: str, *, level: str = TrainingEvent.Level.INFO,
           data: dict[str, Any] | None = None) -> None:
    """Ends the (locked) job: final status, lease released, one event."""
    job.status = status
    job.finished_at = timezone.now()
    job.lease_token = ""
    job.estimated_finish = None
    job.pause_requested_at = None
    job.save()
    event(job, message, level=level, data=data)


def pause(job: TrainingJob) -> None:
    """Pauses the (locked) job: no lease, no longer counting toward the tenant's concurrent-job limit,
    its newest checkpoint the point it resumes from; one event. The caller lets the next job start
    (training.concurrency.training_jobs_dispatch, after its commit)."""
    newest = Checkpoint.objects.filter(job=job).order_by("-step").values_list("step", flat=True).first() or 0
    job.status = Status.PAUSED
    job.lease_token = ""
    job.dispatched_at = job.interrupted_at = job.pause_requested_at = job.estimated_finish = None
    job.step = newest
    job.save()
    where = f"the checkpoint of step {newest}" if newest else "the start"
    event(job, f"Job paused; it no longer counts toward the tenant's concurrent-job limit, and resumes from {where}.",
          data={"step": newest})


def lease_seconds() -> int:
    return conf.setting_int("TRAINING_LEASE_SECONDS")


def lease_age(job: TrainingJob) -> float | None:
    """Seconds since the last heartbeat of the run holding the job; None when no run holds it."""
    if not job.lease_token or job.heartbeat_at is None:
        return None
    return (timezone.now() - job.heartbeat_at).total_seconds()


def lease_fresh(job: TrainingJob) -> bool:
    """True while the run holding the job reports (its heartbeat is younger than a lease)."""
    age = lease_age(job)
    return age is not None and age < lease_seconds()


def checkpoints_delete(job_id: int) -> None:
    """Deletes the job's checkpoints, files and rows (a run that starts over)."""
    storage = get_storage()
    for checkpoint in Checkpoint.objects.filter(job_id=job_id):
        for prefix in checkpoint.storage_prefixes:  # the state and its servable artifact
            storage.delete_prefix(prefix)
        checkpoint.delete()


def checkpoints_discard(job_id: int) -> None:
    """Deletes a cancelled job's checkpoint rows in the caller's transaction and their files once it
    commits: the cancellation and the empty list are seen together (no reader finds a cancelled job
    still listing checkpoints), and a rolled-back cancellation keeps both rows and files."""
    checkpoints = list(Checkpoint.objects.filter(job_id=job_id))
    prefixes = [prefix for checkpoint in checkpoints for prefix in checkpoint.storage_prefixes]
    Checkpoint.objects.filter(pk__in=[checkpoint.pk for checkpoint in checkpoints]).delete()

    def delete_files() -> None:
        storage = get_storage()
        for prefix in prefixes:  # the states and their servable artifacts
            storage.delete_prefix(prefix)

    after_commit(delete_files)


def held_out(num_examples: int, fraction: float) -> int:
    """How many of the training examples a `validation_fraction` holds out (at least one, if any)."""
    return max(1, round(num_examples * fraction)) if fraction else 0
