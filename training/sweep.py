"""The periodic repair (a Celery beat task): starts the waiting jobs whose turn it is, re-sends lost tasks, ends
stuck validations.

A killed worker, a message the broker lost and a task never sent while the broker was down all
leave a job or a dataset waiting for a task that will not come; the sweep finds them by their
timestamps and sends it again. The run's lease (training.run) makes a re-sent task safe.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from functools import partial

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from training import conf
from training.base import Status, after_commit, event, lease_seconds
from training.datasets import validation_record, validation_send
from training.examples import Problem
from training.models import Dataset, TrainingEvent, TrainingJob
from training.concurrency import run_send, training_jobs_dispatch
from training.validation import ValidationReport

logger = logging.getLogger(__name__)
# A dataset whose validation task was not sent this long after its upload is sent by the sweep.
UNSENT_TASK_SECONDS = 60


def training_jobs_sweep() -> dict[str, list[int]]:
    """The periodic repair: starts the waiting jobs whose turn it is, re-sends tasks that were lost, ends stuck
    validations.

    - A running job whose run has not reported for two leases is re-sent (its worker was killed, and
      its unacknowledged task would come back only after the broker's visibility timeout); the
      claim makes the new delivery take over, resuming from the last checkpoint.
    - A queued job's task is presumed lost when no worker took it within the visibility timeout.
    - A dataset whose validation task was never sent (the broker was down) is sent after
      UNSENT_TASK_SECONDS; one sent but never started, after the visibility timeout.
    - A validation running longer than TRAINING_VALIDATION_TIMEOUT_SECONDS ends the dataset invalid.
    """
    dispatched = training_jobs_dispatch()
    now = timezone.now()
    visibility = settings.CELERY_BROKER_TRANSPORT_OPTIONS.get("visibility_timeout", 3600)
    expired = now - timedelta(seconds=2 * lease_seconds())
    lost = expired - timedelta(seconds=visibility)
    stale = TrainingJob.objects.filter(
        Q(status=Status.QUEUED, dispatched_at__lt=lost)
        # dispatched_at is when its task was last sent: a resent task is given two leases to start.
        | Q(status=Status.RUNNING, heartbeat_at__lt=expired, dispatched_at__lt=expired)
    )
    resent = []
    for job in stale:
        with transaction.atomic():
            TrainingJob.objects.filter(pk=job.pk).update(dispatched_at=now)
            event(job, "No worker has reported on this job for two leases; its task was sent again.",
                  level=TrainingEvent.Level.WARNING)
            after_commit(partial(run_send, job.pk))
        resent.append(job.pk)
    unsent = Q(validation_queued_at__isnull=True, created_at__lt=now - timedelta(seconds=UNSENT_TASK_SECONDS))
    unvalidated = list(Dataset.objects.filter(unsent | Q(validation_queued_at__lt=lost), status=Dataset.Status.UPLOADED)
                       .values_list("pk", flat=True))
    for dataset_id in unvalidated:
        after_commit(partial(validation_send, dataset_id))
    return {"dispatched": dispatched, "resent": resent, "validations": unvalidated,
            "validations_timed_out": _end_stuck_validations(now)}


def _end_stuck_validations(now: datetime) -> list[int]:
    """Datasets `validating` for longer than the timeout, ended invalid with a message; their ids."""
    timeout = conf.setting_int("TRAINING_VALIDATION_TIMEOUT_SECONDS")
    since = now - timedelta(seconds=timeout)
    stuck = list(Dataset.objects.filter(
        Q(validation_started_at__lt=since) | Q(validation_started_at__isnull=True, created_at__lt=since),
        status=Dataset.Status.VALIDATING).values_list("pk", flat=True))
    for dataset_id in stuck:
        report = ValidationReport()
        report.add_error(None, Problem("validation_timeout", f"Validation did not finish within {timeout} s (its worker "
                                                             "may have been stopped by the file); check the file, "
                                                             "and upload it again."))
        if validation_record(dataset_id, report) is not None:
            logger.warning("Dataset %s: validation did not finish within %s s; marked invalid", dataset_id, timeout)
    return stuck
