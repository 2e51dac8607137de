"""Datasets: upload (streamed, with its sha256), validation against the stored file, deletion.

A dataset is validated by a Celery task sent after its upload commits, one file of a tenant at a
time: a tenant's next file is sent when its previous one's report is recorded, so ten large files
of one tenant hold one of the quick worker's slots, never all of them. The jobs waiting for a file
are settled once its report is recorded (training.jobs.training_jobs_release).
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from functools import partial
from pathlib import Path
from typing import IO, Any

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from serving.contracts.errors import Conflict, InvalidInput, NotFound, PayloadTooLarge, ServiceError
from serving.registry.storage import get_storage
from runtime.storage import Source
from tenants.models import Tenant
from training import conf, dispatch
from training.base import after_commit
from training.examples import Problem
from training.jobs import training_jobs_release
from training.models import Dataset, TrainingJob
from training.validation import ValidationReport, iter_lines, timeout_problem, validate_lines

logger = logging.getLogger(__name__)


def dataset_create(*, tenant: Tenant, source: Source, filename: str, size: int | None = None) -> Dataset:
    """Stores an uploaded JSONL file (streamed, with its sha256) and queues its validation.

    Refused: a 0-byte file, and anything over the tier's limit (PayloadTooLarge, checked while
    streaming too, since a declared size can lie). Nothing is stored when it is refused.
    """
    limit = conf.dataset_max_bytes(tenant.tier.name)
    if size == 0:
        raise InvalidInput("The uploaded file is empty (0 bytes); upload a JSONL file with one example per line.",
                           code="empty_file", param="file")
    if size is not None and size > limit:
        raise dataset_too_large(size, limit, tenant)
    storage = get_storage()
    key = f"datasets/{tenant.slug}/{uuid.uuid4().hex}.jsonl"
    try:
        stored = storage.put(key, source, max_bytes=limit)
    except ServiceError as error:
        if error.code == "payload_too_large":
            raise dataset_too_large(None, limit, tenant) from None
        raise
    try:
        if stored.size == 0:
            raise InvalidInput("The uploaded file is empty (0 bytes); upload a JSONL file with one example per "
                               "line.", code="empty_file", param="file")
        with transaction.atomic():
            dataset = Dataset.objects.create(
                tenant=tenant, filename=(filename or "dataset.jsonl")[:255], storage_key=key,
                sha256=stored.sha256, size_bytes=stored.size,
            )
    except BaseException:
        storage.delete(key)
        raise
    # Outside the clean-up above: once the row is committed its file stays, whatever the broker does.
    after_commit(partial(validation_send, dataset.pk))
    return dataset


def dataset_too_large(size: int | None, limit: int, tenant: Tenant | None) -> ServiceError:
    """The error for a dataset over its limit (also raised by the API's streaming upload handler)."""
    what = f"The file is {size} bytes" if size is not None else "The file is larger than the limit"
    tier = f"on tier '{tenant.tier.name}' " if tenant is not None else ""
    return PayloadTooLarge(f"{what}; datasets {tier}may be at most {limit} bytes. Split the file or ask for a "
                           "higher tier.", code="dataset_too_large", param="file")


def validation_send(dataset_id: int) -> None:
    """Sends the dataset's validation task (after its upload committed, or again from the sweep),
    unless another file of its tenant is being validated: then it is sent when that one ends."""
    with transaction.atomic():
        dataset = Dataset.objects.filter(pk=dataset_id, status=Dataset.Status.UPLOADED).first()
        if dataset is None:
            return
        # The tenant's row lock orders its uploads' sends: two committing at once do not both go.
        Tenant.objects.select_for_update().filter(pk=dataset.tenant_id).first()
        in_flight = Dataset.objects.filter(
            Q(status=Dataset.Status.VALIDATING) | Q(status=Dataset.Status.UPLOADED, validation_queued_at__isnull=False),
            tenant_id=dataset.tenant_id).exclude(pk=dataset_id)
        if in_flight.exists():
            return
        Dataset.objects.filter(pk=dataset_id).update(validation_queued_at=timezone.now())
    try:
        dispatch.task_send(dispatch.VALIDATE_DATASET, dataset_id)
    except Exception:
        # Not sent: it waits again, for the sweep to send it (and holds no place its tenant's next needs).
        Dataset.objects.filter(pk=dataset_id, status=Dataset.Status.UPLOADED).update(validation_queued_at=None)
        raise


def _validation_send_next(tenant_id: int) -> None:
    """The tenant's oldest file still waiting for its validation, sent now that one ended."""
    waiting = (Dataset.objects.filter(tenant_id=tenant_id, status=Dataset.Status.UPLOADED,
                                      validation_queued_at__isnull=True).order_by("pk").values_list("pk", flat=True))
    if (next_id := waiting.first()) is not None:
        validation_send(next_id)


def dataset_validate(*, dataset_id: int) -> Dataset | None:
    """Checks the stored file and records the report: ready or invalid. None if the dataset is gone.

    Idempotent: a dataset already ready or invalid is returned as it is; one left `validating` by a
    lost worker is checked again (its first start is kept, so the sweep's timeout bounds every
    attempt together). Any failure of the check itself ends the dataset invalid with a message.
    Either way the jobs waiting for it are then settled (training_jobs_release).
    """
    with transaction.atomic():
        dataset = Dataset.objects.select_for_update().filter(pk=dataset_id).first()
        if dataset is None or dataset.status in (Dataset.Status.READY, Dataset.Status.INVALID):
            if dataset is not None:
                # A redelivery: settle the jobs an earlier delivery validated the file for but never settled.
                training_jobs_release(dataset_id=dataset_id)
            return dataset
        dataset.status = Dataset.Status.VALIDATING
        dataset.validation_started_at = dataset.validation_started_at or timezone.now()
        dataset.save(update_fields=["status", "validation_started_at"])
    try:
        report = _validate_stored(dataset)
    except SoftTimeLimitExceeded:
        # The task's own limit, past the budget: one line's check never came back (training.tasks).
        report = ValidationReport()
        report.add_error(None, timeout_problem(validation_budget_s()))
    except Exception as error:
        logger.exception("Validation of dataset %s failed", dataset_id)
        report = ValidationReport()
        report.add_error(None, Problem("validation_failed", f"Validation stopped unexpectedly ({type(error).__name__})"
                                                            "; upload the file again, and if this repeats, contact "
                                                            "the platform operator."))
    return validation_record(dataset_id, report)


def validation_budget_s() -> int:
    """How long the check of one file may take (TRAINING_VALIDATION_TIMEOUT_SECONDS)."""
    return conf.setting_int("TRAINING_VALIDATION_TIMEOUT_SECONDS")


def _validate_stored(dataset: Dataset) -> ValidationReport:
    """The report on the dataset's stored file."""
    tokenizer = _base_tokenizer()
    try:
        with get_storage().open(dataset.storage_key) as raw:
            hashed = _HashingStream(raw)
            report = validate_lines(iter_lines(hashed), tokenizer=tokenizer,
                                    max_seq_length=conf.max_seq_length_default(), time_budget_s=validation_budget_s())
            hashed.drain()
        if hashed.hexdigest() != dataset.sha256:
            report.add_error(None, Problem("checksum_mismatch", "The stored file no longer matches the sha256 taken "
                                                                "at upload; upload it again."))
    except NotFound:
        report = ValidationReport()
        report.add_error(None, Problem("file_missing", "The uploaded file is missing from storage; upload it again."))
    if tokenizer is None:
        report.add_warning(None, Problem("tokens_not_counted",
                                         "The base model's tokenizer is not available, so tokens were not counted."))
    return report


def validation_record(dataset_id: int, report: ValidationReport) -> Dataset | None:
    """Ends a `validating` dataset ready or invalid with its report (one another run ended is left)."""
    updated = Dataset.objects.filter(pk=dataset_id, status=Dataset.Status.VALIDATING).update(
        status=Dataset.Status.READY if report.is_valid else Dataset.Status.INVALID, format=report.format or "",
        num_examples=report.num_examples, report=report.to_dict(), validated_at=timezone.now(),
    )
    if not updated:
        return Dataset.objects.filter(pk=dataset_id).first()
    training_jobs_release(dataset_id=dataset_id)
    dataset = Dataset.objects.get(pk=dataset_id)
    after_commit(partial(_validation_send_next, dataset.tenant_id))
    return dataset


class _HashingStream:
    """Reads through a stream while hashing it, so validation also checks the stored sha256."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self._digest = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        chunk = self._stream.read(size)
        self._digest.update(chunk)
        return chunk

    def drain(self) -> None:
        """Reads what validation left unread (it stops early only on an over-long line)."""
        while self.read(1024 * 1024):
            pass

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def _base_tokenizer() -> Any | None:
    if not (Path(settings.BASE_MODEL_PATH) / "config.json").is_file():
        return None
    # Imported here: it loads torch and transformers, which the web process does not need (nor the
    # `quick` worker until its pool process checks its first file).
    from training.tokenizer import load_tokenizer

    return load_tokenizer(str(settings.BASE_MODEL_PATH))


def dataset_delete(*, dataset: Dataset) -> None:
    """Deletes the dataset and its file; refused while a queued, running or paused job uses it."""
    with transaction.atomic():
        locked = Dataset.objects.select_for_update().filter(pk=dataset.pk).first()
        if locked is None:
            return
        users = list(TrainingJob.objects.filter(Q(dataset=locked) | Q(validation_dataset=locked),
                                                status__in=TrainingJob.ACTIVE_STATUSES).values_list("pk", flat=True))
        if users:
            ids = ", ".join(f"#{pk}" for pk in users)
            raise Conflict(f"Dataset {locked.pk} is used by training job(s) {ids}, which are queued, running or "
                           "paused; wait for them to finish or cancel them first.", code="dataset_in_use")
        key = locked.storage_key
        locked.delete()
        after_commit(partial(_delete_blob, key))
        # Its validation may have been the tenant's one in flight: the next file's turn.
        after_commit(partial(_validation_send_next, locked.tenant_id))


def _delete_blob(key: str) -> None:
    try:
        get_storage().delete(key)
    except Exception:
        logger.exception("Could not delete %s of a deleted dataset; delete it by hand", key)
