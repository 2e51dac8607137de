"""Queries of the training pipeline that views, admin and services share."""

from __future__ import annotations

from typing import BinaryIO

from django.db.models import QuerySet

from lora_platform.errors import NotFound
from lora_platform.storage import get_storage
from training.models import Checkpoint, Dataset, TrainingEvent, TrainingJob


def job_events(*, job: TrainingJob) -> QuerySet[TrainingEvent]:
    return TrainingEvent.objects.filter(job=job).order_by("-id")


def job_checkpoints(*, job: TrainingJob) -> QuerySet[Checkpoint]:
    return Checkpoint.objects.filter(job=job).order_by("-id")


def dataset_content(*, dataset: Dataset) -> BinaryIO:
    """The stored file, as uploaded (a stream to close); NotFound when storage has lost it."""
    try:
        return get_storage().open(dataset.storage_key)
    except NotFound:
        raise NotFound(f"The file of dataset {dataset.pk} is missing from storage; upload it again.",
                       code="file_missing") from None
