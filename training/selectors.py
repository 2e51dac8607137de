"""Queries of the training pipeline that views, admin and services share."""

from __future__ import annotations

from django.db.models import QuerySet

from training.models import Checkpoint, TrainingEvent, TrainingJob


def job_events(*, job: TrainingJob) -> QuerySet[TrainingEvent]:
    return TrainingEvent.objects.filter(job=job).order_by("-id")


def job_checkpoints(*, job: TrainingJob) -> QuerySet[Checkpoint]:
    return Checkpoint.objects.filter(job=job).order_by("-id")
