"""Everything that changes datasets and training jobs, and the run of a job itself.

Concurrency of jobs. A tenant's tier allows `max_concurrent_training_jobs`; a job holds a slot from
the moment its task is sent (`dispatched_at`) until it ends. `training_jobs_dispatch` hands free
slots to the oldest waiting jobs under the tenant's row lock; it runs when a job is created, when a
job ends (the finishing task calls it) and from the periodic `training_jobs_sweep`, which also
re-sends the task of a running job whose run stopped reporting (a killed worker) and of a queued
one no worker took (a message the broker lost). Beyond the slots, a tenant may have
TRAINING_MAX_WAITING_JOBS waiting; more is refused (LimitExceeded).

Broker outages. Tasks are sent after the commit that needs them (`_after_commit`); a send that
fails is logged and never fails the request nor undoes what it committed: an unsent validation is
sent by the sweep, and a job whose task was not sent gives its slot back and is dispatched again.

Redelivery. Celery may deliver a job's task again (a killed worker, the visibility timeout). A
delivery must hold the job's lease to run it: `training_job_claim` grants it when no other run's
heartbeat is fresh, so two runs never train one job at once, and a later run resumes from the last
checkpoint. Finishing is idempotent: the version is fixed on the job before publishing, an
artifact an earlier delivery of the same job published is reused, and the job's link to its
AdapterVersion (one-to-one) is written in the same transaction as the registration.

Locks. Slots and versions are decided under the tenant's row lock, a job's state under its own.
A lock taken through a join names `of=("self",)`: PostgreSQL would otherwise lock the joined rows
too (a tenant's tier), serialising every tenant of that tier.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import secrets
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import IO, Any

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from lora_platform.errors import Conflict, InvalidInput, LimitExceeded, NotFound, PayloadTooLarge, ServiceError
from lora_platform.storage import Source, get_storage
from serving import selectors as registry_selectors
from serving import services as registry
from serving.engine.artifact import MANIFEST_NAME, base_config_sha256, manifest_write
from serving.models import Adapter, AdapterVersion, artifact_prefix
from serving.versions import version_next_patch, version_parse
from tenants.models import Tenant
from training import conf, dispatch
from training.examples import Problem
from training.hyperparameters import Hyperparameters, Limits, default_max_seq_length, resolve_hyperparameters
from training.models import Checkpoint, Dataset, TrainingEvent, TrainingJob
from training.validation import ValidationReport, iter_lines, iter_valid_examples, validate_lines

logger = logging.getLogger(__name__)

Status = TrainingJob.Status
# A dataset in these is still being validated: no job trains on it yet.
PENDING_DATASET_STATUSES = (Dataset.Status.UPLOADED, Dataset.Status.VALIDATING)
MAX_SEED = 2**31 - 1
MAX_VALIDATION_FRACTION = 0.5
# A job is saved no more often than this while it runs (metrics events are separate).
PROGRESS_INTERVAL_SECONDS = 1.0
# A dataset whose validation task was not sent this long after its upload is sent by the sweep.
UNSENT_TASK_SECONDS = 60


def _after_commit(action: Callable[[], object]) -> None:
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


# --- datasets ---------------------------------------------------------------------------------


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
    _after_commit(partial(_send_validation, dataset.pk))
    return dataset


def dataset_too_large(size: int | None, limit: int, tenant: Tenant | None) -> ServiceError:
    """The error for a dataset over its limit (also raised by the API's streaming upload handler)."""
    what = f"The file is {size} bytes" if size is not None else "The file is larger than the limit"
    tier = f"on tier '{tenant.tier.name}' " if tenant is not None else ""
    return PayloadTooLarge(f"{what}; datasets {tier}may be at most {limit} bytes. Split the file or ask for a "
                           "higher tier.", code="dataset_too_large", param="file")


def _send_validation(dataset_id: int) -> None:
    dispatch.task_send(dispatch.VALIDATE_DATASET, dataset_id)
    # Only a sent task is recorded: a dataset left without one is sent again by the sweep.
    Dataset.objects.filter(pk=dataset_id, status=Dataset.Status.UPLOADED).update(validation_queued_at=timezone.now())


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
    except Exception as error:
        logger.exception("Validation of dataset %s failed", dataset_id)
        report = ValidationReport()
        report.add_error(None, Problem("validation_failed", f"Validation stopped unexpectedly ({type(error).__name__})"
                                                            "; upload the file again, and if this repeats, contact "
                                                            "the platform operator."))
    return _record_validation(dataset_id, report)


def _validate_stored(dataset: Dataset) -> ValidationReport:
    """The report on the dataset's stored file."""
    tokenizer = _base_tokenizer()
    try:
        with get_storage().open(dataset.storage_key) as raw:
            hashed = _HashingStream(raw)
            report = validate_lines(iter_lines(hashed), tokenizer=tokenizer,
                                    max_seq_length=_default_max_seq_length())
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


def _record_validation(dataset_id: int, report: ValidationReport) -> Dataset | None:
    """Ends a `validating` dataset ready or invalid with its report (one another run ended is left)."""
    updated = Dataset.objects.filter(pk=dataset_id, status=Dataset.Status.VALIDATING).update(
        status=Dataset.Status.READY if report.is_valid else Dataset.Status.INVALID, format=report.format or "",
        num_examples=report.num_examples, report=report.to_dict(), validated_at=timezone.now(),
    )
    if not updated:
        return Dataset.objects.filter(pk=dataset_id).first()
    training_jobs_release(dataset_id=dataset_id)
    return Dataset.objects.get(pk=dataset_id)


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
    # Imported here: it loads torch and transformers, which the web process does not need.
    from training.trainer import load_tokenizer

    return load_tokenizer(str(settings.BASE_MODEL_PATH))


def _base_max_positions() -> int | None:
    try:
        config = json.loads((Path(settings.BASE_MODEL_PATH) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("max_position_embeddings") if isinstance(config, dict) else None


def _limits() -> Limits:
    cap = conf.setting_int("TRAINING_MAX_SEQ_LENGTH")
    positions = _base_max_positions()
    return Limits(max_rank=settings.MAX_LORA_RANK, max_seq_length=min(cap, positions) if positions else cap)


def _default_max_seq_length() -> int:
    return default_max_seq_length(_limits())


def dataset_delete(*, dataset: Dataset) -> None:
    """Deletes the dataset and its file; refused while a queued or running job uses it."""
    with transaction.atomic():
        locked = Dataset.objects.select_for_update().filter(pk=dataset.pk).first()
        if locked is None:
            return
        users = list(TrainingJob.objects.filter(Q(dataset=locked) | Q(validation_dataset=locked),
                                                status__in=TrainingJob.ACTIVE_STATUSES).values_list("pk", flat=True))
        if users:
            ids = ", ".join(f"#{pk}" for pk in users)
            raise Conflict(f"Dataset {locked.pk} is used by training job(s) {ids}, which are queued or running; "
                           "wait for them to finish or cancel them first.", code="dataset_in_use")
        key = locked.storage_key
        locked.delete()
        _after_commit(partial(_delete_blob, key))


def _delete_blob(key: str) -> None:
    try:
        get_storage().delete(key)
    except Exception:
        logger.exception("Could not delete %s of a deleted dataset; delete it by hand", key)


# --- creating, cancelling, retrying jobs -------------------------------------------------------


def _ready_dataset(tenant: Tenant, dataset_id: Any, param: str, *, pending_ok: bool = False) -> Dataset:
    if isinstance(dataset_id, bool) or not isinstance(dataset_id, int):
        raise InvalidInput(f"'{param}' must be a dataset id (an integer).", param=param)
    # Locked so that a concurrent delete waits for this job to exist (and then refuses).
    dataset = Dataset.objects.for_tenant(tenant).select_for_update().filter(pk=dataset_id).first()
    if dataset is None:
        raise NotFound(f"No dataset with id {dataset_id}.", code="dataset_not_found", param=param)
    if dataset.status in PENDING_DATASET_STATUSES and not pending_ok:
        raise Conflict(f"Dataset {dataset_id} is still being validated; create the job once its status is "
                       "'ready'.", code="dataset_not_ready", param=param)
    if dataset.status == Dataset.Status.INVALID:
        errors = sum(dataset.report.get("error_counts", {}).values())
        raise InvalidInput(f"Dataset {dataset_id} is invalid ({errors} error(s)); see its report at "
                           f"GET /api/v1/datasets/{dataset_id}, fix the file and upload it again.",
                           code="dataset_invalid", param=param)
    return dataset


def _check_adapter_name(tenant: Tenant, name: Any) -> bool:
    """True when the adapter exists; InvalidInput/LimitExceeded (the registry's own rule) when a new one
    cannot be made."""
    registry.adapter_name_validate(name, param="adapter")
    if Adapter.objects.for_tenant(tenant).filter(name=name).exists():
        return True
    registry.adapter_room_check(tenant=tenant, param="adapter")
    return False


def _check_requested_version(tenant: Tenant, adapter_name: str, version: Any) -> str:
    if version in (None, ""):
        return ""
    version_parse(version)
    taken = AdapterVersion.objects.for_tenant(tenant).filter(
        adapter__name=adapter_name, version=version).exists()
    reserved = TrainingJob.objects.for_tenant(tenant).filter(
        adapter_name=adapter_name, version=version).exclude(status__in=(Status.FAILED, Status.CANCELLED)).exists()
    if taken or reserved:
        raise Conflict(f"Adapter '{adapter_name}' already has (or a job is producing) version {version}; versions "
                       "are immutable, so choose another or leave it out for the next patch.",
                       code="version_exists", param="version")
    return version


def _validation_fraction(value: Any, dataset: Dataset, validation_dataset: Dataset | None) -> float:
    if value in (None, 0, 0.0):
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_VALIDATION_FRACTION:
        raise InvalidInput(f"'validation_fraction' must be a number above 0 and at most {MAX_VALIDATION_FRACTION}.",
                           code="invalid_validation_fraction", param="validation_fraction")
    if validation_dataset is not None:
        raise InvalidInput("Give either 'validation_file' or 'validation_fraction', not both.",
                           param="validation_fraction")
    if (dataset.num_examples or 0) - _held_out(dataset.num_examples or 0, value) < 1:
        raise InvalidInput(f"Dataset {dataset.pk} has {dataset.num_examples} example(s): too few to hold "
                           f"{value:.0%} out for validation.", param="validation_fraction")
    return float(value)


def _planned_steps(num_examples: int, fraction: float, hp: Hyperparameters) -> int:
    """Steps the job will take (exact unless truncation leaves some examples nothing to learn)."""
    train = num_examples - _held_out(num_examples, fraction)
    return -(-train // hp.batch_size) * hp.n_epochs


def _held_out(num_examples: int, fraction: float) -> int:
    return max(1, round(num_examples * fraction)) if fraction else 0


def _check_seed(seed: Any) -> int:
    if seed is None:
        return random.SystemRandom().randint(0, MAX_SEED)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise InvalidInput(f"'seed' must be an integer from 0 to {MAX_SEED}.", param="seed")
    return seed


def training_job_create(*, tenant: Tenant, training_file: Any, adapter: Any, validation_file: Any = None,
                        validation_fraction: Any = None, version: Any = None,
                        hyperparameters: dict[str, Any] | None = None, seed: Any = None, base_model: Any = None,
                        metadata: Any = None, await_validation: bool = False) -> TrainingJob:
    """A queued job; it starts once the tenant has a free slot (module docstring).

    Every input is checked first (datasets ready and the tenant's, adapter name and tier's adapter
    limit, version, hyperparameters against the platform limits, base model, metadata, waiting-job
    limit); a refused job leaves nothing behind. With `await_validation` (OpenAI's behaviour) the
    files may still be being validated: the job waits for them (`training_jobs_release`) and fails
    if one turns out invalid.
    """
    hp = resolve_hyperparameters(hyperparameters, _limits())
    seed = _check_seed(seed)
    _check_base_model(base_model)
    metadata = _check_metadata(metadata)
    with transaction.atomic():
        locked = Tenant.objects.select_for_update(of=("self",)).select_related("tier").get(pk=tenant.pk)
        dataset = _ready_dataset(locked, training_file, "training_file", pending_ok=await_validation)
        validation = (_ready_dataset(locked, validation_file, "validation_file", pending_ok=await_validation)
                      if validation_file is not None else None)
        pending = _files_pending(dataset, validation)
        if pending and validation_fraction not in (None, 0, 0.0):
            raise InvalidInput("'validation_fraction' needs a validated training file; wait for its status "
                               "'ready', or give a 'validation_file'.", param="validation_fraction")
        fraction = 0.0 if pending else _validation_fraction(validation_fraction, dataset, validation)
        _check_adapter_name(locked, adapter)
        requested = _check_requested_version(locked, adapter, version)
        _check_waiting_room(locked)
        job = TrainingJob.objects.create(
            tenant=locked, dataset=dataset, validation_dataset=validation, validation_fraction=fraction,
            adapter_name=adapter, version=requested, requested_version=requested,
            base_model=settings.BASE_MODEL_NAME, hyperparameters=hp.to_dict(), seed=seed, metadata=metadata,
            total_steps=None if pending else _planned_steps(dataset.num_examples or 0, fraction, hp),
        )
        examples = "its files are being validated" if pending else f"{dataset.num_examples} examples"
        _event(job, f"Job created: adapter '{adapter}', {examples}, {hp.n_epochs} epoch(s).")
        _after_commit(partial(training_jobs_dispatch, tenant_id=locked.pk))
    return job


MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


def _check_base_model(name: Any) -> None:
    """A job names the base model it trains on (OpenAI's `model`); only the platform's one is offered."""
    if name is None:
        return
    accepted = registry_selectors.accepted_base_models()
    if name not in accepted:
        raise InvalidInput(f"Model {name!r} is not available for fine-tuning; this platform fine-tunes "
                           f"{' or '.join(repr(item) for item in accepted)} (fine-tuning an adapter again is not "
                           "supported: train a new version from the base).", code="model_not_available",
                           param="model")


def _check_metadata(metadata: Any) -> dict[str, str]:
    """OpenAI's metadata rules: up to 16 pairs, keys up to 64 characters, string values up to 512."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise InvalidInput("'metadata' must be an object of string keys and string values.", param="metadata")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidInput(f"'metadata' has {len(metadata)} keys; at most {MAX_METADATA_PAIRS} are allowed.",
                           param="metadata")
    for key, value in metadata.items():
        if not isinstance(key, str) or not 1 <= len(key) <= MAX_METADATA_KEY:
            raise InvalidInput(f"Metadata keys must be strings of 1–{MAX_METADATA_KEY} characters; {key!r} is not.",
                               param="metadata")
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise InvalidInput(f"Metadata value of {key!r} must be a string of at most {MAX_METADATA_VALUE} "
                               "characters.", param=f"metadata.{key}")
    return dict(metadata)


def _files_pending(dataset: Dataset | None, validation: Dataset | None) -> bool:
    return any(item is not None and item.status in PENDING_DATASET_STATUSES for item in (dataset, validation))


def training_jobs_release(*, dataset_id: int) -> list[int]:
    """Settles the waiting jobs whose files include a dataset just validated; the ids it failed.

    A job created while its files were being validated (OpenAI's `validating_files`) fails when one
    of them is invalid, saying which lines are wrong; once all are ready its steps are planned and
    it joins the queue for a slot. Idempotent: a settled job is left as it is.
    """
    failed: list[int] = []
    tenants: set[int] = set()
    waiting = TrainingJob.objects.filter(Q(dataset_id=dataset_id) | Q(validation_dataset_id=dataset_id),
                                         status=Status.QUEUED, dispatched_at__isnull=True)
    for job_id in waiting.values_list("pk", flat=True):
        with transaction.atomic():
            job = (TrainingJob.objects.select_for_update(of=("self",))
                   .select_related("dataset", "validation_dataset").filter(pk=job_id, status=Status.QUEUED).first())
            if job is None or _files_pending(job.dataset, job.validation_dataset):
                continue
            problem = _invalid_file(job)
            if problem is None and job.total_steps is None:
                hp = Hyperparameters.from_dict(job.hyperparameters)
                job.total_steps = _planned_steps(job.dataset.num_examples or 0, job.validation_fraction, hp)
                job.save(update_fields=["total_steps"])
                _event(job, f"Files validated: {job.dataset.num_examples} training examples.")
            if problem is not None:
                job.error_code, job.error_message = problem
                _finish(job, Status.FAILED, job.error_message, level=TrainingEvent.Level.ERROR,
                        data={"code": job.error_code})
                failed.append(job.pk)
            tenants.add(job.tenant_id)
    for tenant_id in sorted(tenants):
        _after_commit(partial(training_jobs_dispatch, tenant_id=tenant_id))
    return failed


def _invalid_file(job: TrainingJob) -> tuple[str, str] | None:
    """(error code, message) when a file of the job failed validation; None when all are ready."""
    for dataset, kind in ((job.dataset, "training"), (job.validation_dataset, "validation")):
        if dataset is None or dataset.status == Dataset.Status.READY:
            continue
        errors = dataset.report.get("errors", [])
        shown = "; ".join(f"line {item['line']}: {item['message']}" if item.get("line") else item["message"]
                          for item in errors[:3])
        count = sum(dataset.report.get("error_counts", {}).values())
        more = f" (and {count - 3} more)" if count > 3 else ""
        return (f"invalid_{kind}_file", f"The {kind} file {dataset.filename!r} (dataset {dataset.pk}) is invalid: "
                                        f"{shown}{more}. Fix the file and upload it again.")
    return None


def _check_waiting_room(tenant: Tenant) -> None:
    jobs = TrainingJob.objects.for_tenant(tenant)
    slots = tenant.tier.max_concurrent_training_jobs
    holding = jobs.filter(_holds_slot()).count()
    waiting = jobs.filter(status=Status.QUEUED, dispatched_at__isnull=True).count()
    limit = conf.setting_int("TRAINING_MAX_WAITING_JOBS")
    if holding >= slots and waiting >= limit:
        raise LimitExceeded(
            f"Tenant '{tenant.slug}' is at its training job limit: {holding} job(s) running (tier "
            f"'{tenant.tier.name}' allows {slots} at a time) and {waiting} waiting (at most {limit}). Wait for "
            "a job to finish or cancel one.", code="training_job_limit_reached",
        )


def _holds_slot() -> Q:
    return Q(status=Status.RUNNING) | Q(status=Status.QUEUED, dispatched_at__isnull=False)


def training_job_cancel(*, job: TrainingJob) -> TrainingJob:
    """Cancels a queued job at once; a running one stops before its next step (no artifact is kept)."""
    with transaction.atomic():
        job = TrainingJob.objects.select_for_update().get(pk=job.pk)
        if job.is_final:
            raise Conflict(f"Training job {job.pk} has already {job.status}; only queued or running jobs can be "
                           "cancelled.", code="job_finished")
        if job.cancel_requested_at is None:
            job.cancel_requested_at = timezone.now()
            job.save(update_fields=["cancel_requested_at"])
        if not _lease_fresh(job):
            # Queued, or its worker is gone: no run will see the request, so it ends here.
            _finish(job, Status.CANCELLED, "Job cancelled.")
            _after_commit(partial(_delete_checkpoints, job.pk))
            _after_commit(partial(training_jobs_dispatch, tenant_id=job.tenant_id))
        else:
            _event(job, "Cancellation requested; the job stops before its next step.")
    return job


def training_job_retry(*, job: TrainingJob) -> TrainingJob:
    """Queues a failed or cancelled job again; a failed one resumes from its last checkpoint."""
    with transaction.atomic():
        job = TrainingJob.objects.select_for_update().get(pk=job.pk)
        if job.status not in (Status.FAILED, Status.CANCELLED):
            raise Conflict(f"Training job {job.pk} is {job.status}; only failed or cancelled jobs can be retried.",
                           code="job_not_retryable")
        if job.dataset is None or job.dataset.status != Dataset.Status.READY:
            raise Conflict(f"The dataset of training job {job.pk} was deleted; create a new job.",
                           code="dataset_not_found")
        job.status = Status.QUEUED
        job.error_code = job.error_message = ""
        job.dispatched_at = job.cancel_requested_at = job.finished_at = job.heartbeat_at = None
        job.lease_token = ""
        resume = job.checkpoints.first()
        job.step = resume.step if resume else 0
        job.save()
        _event(job, "Job retried" + (f"; it resumes from step {resume.step}." if resume else "."))
        _after_commit(partial(training_jobs_dispatch, tenant_id=job.tenant_id))
    return job


# --- slots ------------------------------------------------------------------------------------


def training_jobs_dispatch(*, tenant_id: int) -> list[int]:
    """Sends the tasks of the tenant's oldest waiting jobs that fit in its free slots; their ids."""
    with transaction.atomic():
        tenant = Tenant.objects.select_for_update(of=("self",)).select_related("tier").filter(pk=tenant_id).first()
        if tenant is None:
            return []
        jobs = TrainingJob.objects.for_tenant(tenant)
        free = tenant.tier.max_concurrent_training_jobs - jobs.filter(_holds_slot()).count()
        if free <= 0:
            return []
        # A job whose files are still being validated waits for them (training_jobs_release).
        waiting = list(jobs.filter(status=Status.QUEUED, dispatched_at__isnull=True,
                                   dataset__status=Dataset.Status.READY)
                       .exclude(validation_dataset__status__in=PENDING_DATASET_STATUSES).order_by("id")[:free])
        now = timezone.now()
        for job in waiting:
            job.dispatched_at = now
            job.save(update_fields=["dispatched_at"])
            _event(job, "A training slot is free; the job is waiting for a worker.")
            _after_commit(partial(_send_run, job.pk))
    return [job.pk for job in waiting]


def _send_run(job_id: int) -> None:
    try:
        dispatch.task_send(dispatch.RUN_JOB, job_id)
    except Exception:
        # Not sent (the broker is down): a queued job gives its slot back and waits again, so the
        # sweep's next dispatch sends it once the broker is back, instead of holding the slot forever.
        TrainingJob.objects.filter(pk=job_id, status=Status.QUEUED, lease_token="").update(dispatched_at=None)
        raise


def training_jobs_sweep() -> dict[str, list[int]]:
    """The periodic repair: fills free slots everywhere, re-sends tasks that were lost, ends stuck validations.

    - A running job whose run has not reported for two leases is re-sent (its worker was killed, and
      its unacknowledged task would come back only after the broker's visibility timeout); the
      claim makes the new delivery take over, resuming from the last checkpoint.
    - A queued job's task is presumed lost when no worker took it within the visibility timeout.
    - A dataset whose validation task was never sent (the broker was down) is sent after
      UNSENT_TASK_SECONDS; one sent but never started, after the visibility timeout.
    - A validation running longer than TRAINING_VALIDATION_TIMEOUT_SECONDS ends the dataset invalid.
    """
    tenants = set(TrainingJob.objects.filter(status=Status.QUEUED, dispatched_at__isnull=True)
                  .values_list("tenant_id", flat=True))
    dispatched = [pk for tenant_id in sorted(tenants) for pk in training_jobs_dispatch(tenant_id=tenant_id)]
    now = timezone.now()
    visibility = settings.CELERY_BROKER_TRANSPORT_OPTIONS.get("visibility_timeout", 3600)
    expired = now - timedelta(seconds=2 * _lease_seconds())
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
            _event(job, "No worker has reported on this job for two leases; its task was sent again.",
                   level=TrainingEvent.Level.WARNING)
            _after_commit(partial(_send_run, job.pk))
        resent.append(job.pk)
    unsent = Q(validation_queued_at__isnull=True, created_at__lt=now - timedelta(seconds=UNSENT_TASK_SECONDS))
    unvalidated = list(Dataset.objects.filter(unsent | Q(validation_queued_at__lt=lost), status=Dataset.Status.UPLOADED)
                       .values_list("pk", flat=True))
    for dataset_id in unvalidated:
        _after_commit(partial(_send_validation, dataset_id))
    return {"dispatched": dispatched, "resent": resent, "validations": unvalidated,
            "validations_timed_out": _end_stuck_validations(now)}


def _end_stuck_validations(now: Any) -> list[int]:
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
        if _record_validation(dataset_id, report) is not None:
            logger.warning("Dataset %s: validation did not finish within %s s; marked invalid", dataset_id, timeout)
    return stuck


# --- running a job ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """The outcome of asking for a job's lease: a token to run with, or why not (and when to ask again)."""

    job: TrainingJob | None
    token: str = ""
    retry_in: float | None = None
    reason: str = ""


def _lease_seconds() -> int:
    return conf.setting_int("TRAINING_LEASE_SECONDS")


def _lease_fresh(job: TrainingJob) -> bool:
    if not job.lease_token or job.heartbeat_at is None:
        return False
    return (timezone.now() - job.heartbeat_at).total_seconds() < _lease_seconds()


def training_job_claim(*, job_id: int) -> Claim:
    """The lease of a job for this delivery, if the job still needs a run and no live run holds it."""
    with transaction.atomic():
        job = TrainingJob.objects.select_for_update(of=("self",)).select_related("tenant").filter(pk=job_id).first()
        if job is None:
            return Claim(None, reason="the job no longer exists")
        if job.is_final:
            return Claim(None, reason=f"the job has already {job.status}")
        if _lease_fresh(job):
            age = (timezone.now() - job.heartbeat_at).total_seconds()
            return Claim(None, retry_in=max(1.0, _lease_seconds() - age), reason="another run holds the job")
        if job.cancel_requested_at is not None:
            _finish(job, Status.CANCELLED, "Job cancelled.")
            _after_commit(partial(_delete_checkpoints, job.pk))
            _after_commit(partial(training_jobs_dispatch, tenant_id=job.tenant_id))
            return Claim(None, reason="the job was cancelled")
        lost = job.status == Status.RUNNING
        token = secrets.token_hex(16)
        now = timezone.now()
        job.lease_token, job.heartbeat_at = token, now
        job.attempts += 1
        job.status = Status.RUNNING
        job.started_at = job.started_at or now
        job.dispatched_at = job.dispatched_at or now
        job.save()
        if lost:
            _event(job, f"The previous worker stopped reporting; attempt {job.attempts} takes over.",
                   level=TrainingEvent.Level.WARNING)
        else:
            _event(job, f"Training started (attempt {job.attempts}).")
    return Claim(job, token=token)


def training_job_run(*, job_id: int) -> Claim:
    """Runs a job to its end for this delivery (the Celery task's body); returns the claim it got.

    A claim without a job means there is nothing to do now (finished, cancelled, or held by a
    live run, in which case `retry_in` says when to look again).
    """
    claim = training_job_claim(job_id=job_id)
    if claim.job is None:
        return claim
    job = claim.job
    workspace = _scratch_create(job.pk)
    try:
        with _heartbeat(job.pk, claim.token):
            _run_claimed(job, claim.token, workspace)
    except _LeaseLost:
        logger.warning("Training job %s was taken over by another run; this run stops", job.pk)
    except JobFailure as failure:
        _end_failed(job, claim.token, failure.code, failure.message)
    except Exception as error:
        logger.exception("Training job %s failed", job.pk)
        _end_failed(job, claim.token, "internal_error",
                    f"Training failed unexpectedly ({type(error).__name__}: {error}). Retry the job; if it fails "
                    "again, contact the platform operator.")
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
        training_jobs_dispatch(tenant_id=job.tenant_id)
    return claim


def _scratch_create(job_id: int) -> Path:
    """A run's own scratch folder; its name carries host and pid, so a later sweep knows its owner."""
    root = conf.scratch_dir()
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"job-{job_id}-{socket.gethostname()}-{os.getpid()}-", dir=root))


def training_scratch_sweep() -> list[Path]:
    """Removes scratch folders of runs on this host whose process is gone (a killed worker); the removed.

    A run removes its own folder on every exit it lives through; a SIGKILL (or power loss) leaves
    it, holding the tenant's dataset, so each worker sweeps at start. A folder whose pid is alive is
    left alone: another worker's run on this host (pid reuse by an unrelated process keeps one a
    little longer, never removes a live one).
    """
    root = conf.scratch_dir()
    if not root.is_dir():
        return []
    host = socket.gethostname()
    removed = []
    for folder in root.iterdir():
        match = re.fullmatch(rf"job-\d+-{re.escape(host)}-(\d+)-.+", folder.name)
        if match is None or _process_alive(int(match.group(1))):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


class _LeaseLost(Exception):
    """Another delivery took the job over (this run's heartbeat was too old); stop without writing."""


@contextmanager
def _heartbeat(job_id: int, token: str) -> Iterator[None]:
    """Refreshes the lease from a thread, so a long step (or a slow upload) never looks like a dead worker."""
    stop = threading.Event()
    interval = max(0.5, _lease_seconds() / 4)

    def beat() -> None:
        try:
            while not stop.wait(interval):
                try:
                    TrainingJob.objects.filter(pk=job_id, lease_token=token).update(heartbeat_at=timezone.now())
                except DatabaseError:
                    # A missed beat only matters if the database stays away for a whole lease.
                    logger.warning("Training job %s: heartbeat not recorded", job_id, exc_info=True)
        finally:
            connection.close()

    thread = threading.Thread(target=beat, name=f"training-job-{job_id}-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _run_claimed(job: TrainingJob, token: str, workspace: Path) -> None:
    from training.trainer import CheckpointMismatch, LoraTrainer, TrainingSetupError, TrainingStopped, load_base

    if job.version and _own_artifact(job, job.version):
        _event(job, f"Version {job.version} was already published by an earlier attempt; registering it.")
        _register(job, token, _artifact_prefix(job, job.version), reused=True)
        return
    if job.dataset is None:
        raise JobFailure("The job's dataset was deleted; create a new job.", code="dataset_not_found")
    base = load_base(str(settings.BASE_MODEL_PATH))
    hp = Hyperparameters.from_dict(job.hyperparameters)
    train, valid = _load_examples(job, hp, base.tokenizer, workspace)
    hooks = _JobHooks(job, token)
    try:
        trainer = LoraTrainer(
            base, hp, seed=job.seed, train=train, valid=valid, hooks=hooks, work_dir=workspace / "run",
            fingerprint=_fingerprint(job), base_model_name=settings.BASE_MODEL_NAME,
            checkpoint_every=conf.setting_int("TRAINING_CHECKPOINT_EVERY_STEPS"),
            log_every=conf.setting_int("TRAINING_LOG_EVERY_STEPS"),
        )
        resume = _fetch_checkpoint(job, workspace)
        try:
            result = trainer.run(resume_from=resume)
        except CheckpointMismatch:
            _event(job, "The last checkpoint does not match this job's data or settings; starting over.",
                   level=TrainingEvent.Level.WARNING)
            _delete_checkpoints(job.pk)
            result = trainer.run()
    except TrainingSetupError as error:
        raise JobFailure(str(error), code="invalid_training_setup") from None
    except TrainingStopped:
        hooks.raise_if_lease_lost()
        _end_cancelled(job, token)
        return
    _publish_and_register(job, token, result.adapter_dir)


def _load_examples(job: TrainingJob, hp: Hyperparameters, tokenizer: Any, workspace: Path) -> tuple[list, list]:
    from training.examples import EncodingError, encode_example

    def encoded(dataset: Dataset) -> list:
        path = get_storage().download(dataset.storage_key, workspace / f"dataset-{dataset.pk}.jsonl")
        try:
            with path.open("rb") as stream:
                return [encode_example(example, tokenizer, hp.max_seq_length)
                        for example in iter_valid_examples(iter_lines(stream), dataset.format)]
        except (ValueError, EncodingError) as error:
            raise JobFailure(f"Dataset {dataset.pk} cannot be trained on: {error}.", code="dataset_unusable") from None

    examples = encoded(job.dataset)
    if job.validation_dataset is not None:
        train, valid = examples, encoded(job.validation_dataset)
    else:
        order = list(range(len(examples)))
        random.Random(job.seed).shuffle(order)
        held = set(order[:_held_out(len(examples), job.validation_fraction)])
        train = [example for index, example in enumerate(examples) if index not in held]
        valid = [example for index, example in enumerate(examples) if index in held]
    usable = [example for example in train if example.num_trained_tokens]
    truncated = sum(example.truncated for example in train)
    if truncated:
        _event(job, f"{truncated} example(s) are longer than max_seq_length ({hp.max_seq_length}) and were "
                    f"truncated; {len(train) - len(usable)} lost every token to learn and are skipped.",
               level=TrainingEvent.Level.WARNING)
    if not usable:
        raise JobFailure(f"No training example has tokens to learn from within max_seq_length "
                         f"({hp.max_seq_length}); raise it or shorten the examples.", code="no_trainable_examples")
    return usable, [example for example in valid if example.num_trained_tokens]


def _fingerprint(job: TrainingJob) -> str:
    """What a checkpoint must have been trained on to be resumed by this job."""
    parts = {
        "dataset": job.dataset.sha256 if job.dataset else None,
        "validation": job.validation_dataset.sha256 if job.validation_dataset else None,
        "fraction": job.validation_fraction, "hyperparameters": job.hyperparameters, "seed": job.seed,
        "base": base_config_sha256(Path(settings.BASE_MODEL_PATH)),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


class _JobHooks:
    """The trainer's hooks for one job: cancellation, progress, metrics events, checkpoints."""

    def __init__(self, job: TrainingJob, token: str) -> None:
        self.job = job
        self.token = token
        self.lease_lost = False
        self.started = timezone.now()
        self.first_step: int | None = None
        self.last_saved = 0.0
        self.pending: dict[str, Any] = {}

    def _mine(self) -> Any:
        return TrainingJob.objects.filter(pk=self.job.pk, lease_token=self.token)

    def should_stop(self) -> bool:
        row = TrainingJob.objects.filter(pk=self.job.pk).values("lease_token", "cancel_requested_at").first()
        self.lease_lost = row is None or row["lease_token"] != self.token
        return self.lease_lost or row["cancel_requested_at"] is not None

    def raise_if_lease_lost(self) -> None:
        if self.lease_lost:
            raise _LeaseLost()

    def on_step(self, step: int, total_steps: int, epoch: float, trained_tokens: int) -> None:
        if self.first_step is None:
            self.first_step, self.started = step - 1, timezone.now()
        elapsed = (timezone.now() - self.started).total_seconds()
        done = step - self.first_step
        eta = timezone.now() + timedelta(seconds=elapsed / done * (total_steps - step)) if done else None
        self.pending = {"step": step, "total_steps": total_steps, "epoch": epoch, "trained_tokens": trained_tokens,
                        "estimated_finish": eta}
        if time.monotonic() - self.last_saved >= PROGRESS_INTERVAL_SECONDS or step == total_steps:
            self.last_saved = time.monotonic()
            self._save_progress()

    def _save_progress(self) -> None:
        if self.pending and not self._mine().update(**self.pending):
            self.lease_lost = True
            raise _LeaseLost()

    def on_log(self, metrics: Any) -> None:
        data = metrics.to_dict()
        self._mine().update(train_loss=metrics.train_loss,
                            **({"valid_loss": metrics.valid_loss} if metrics.valid_loss is not None else {}))
        valid = f", valid loss {metrics.valid_loss:.4f}" if metrics.valid_loss is not None else ""
        _event(self.job, f"Step {metrics.step}/{metrics.total_steps}: train loss {metrics.train_loss:.4f}{valid}",
               type=TrainingEvent.Type.METRICS, data=data)

    def on_checkpoint(self, step: int, directory: Path, metrics: dict[str, Any]) -> None:
        storage = get_storage()
        prefix = f"checkpoints/{self.job.tenant.slug}/{self.job.pk}/step-{step:08d}"
        # Debris of a run killed while it saved this very step (no row points at it).
        storage.delete_prefix(prefix)
        from training.trainer import STATE_FILE

        storage.publish_directory(directory, prefix, marker=STATE_FILE)
        Checkpoint.objects.update_or_create(job=self.job, step=step,
                                            defaults={"storage_prefix": prefix, "metrics": metrics})
        _event(self.job, f"Checkpoint saved at step {step}.", data={"step": step})
        kept = conf.setting_int("TRAINING_CHECKPOINTS_KEPT")
        for old in Checkpoint.objects.filter(job=self.job).order_by("-step")[max(1, kept):]:
            storage.delete_prefix(old.storage_prefix)
            old.delete()


def _fetch_checkpoint(job: TrainingJob, workspace: Path) -> Path | None:
    checkpoint = Checkpoint.objects.filter(job=job).order_by("-step").first()
    if checkpoint is None:
        return None
    target = workspace / f"resume-{checkpoint.step}"
    try:
        get_storage().download_prefix(checkpoint.storage_prefix, target)
    except NotFound:
        _event(job, f"Checkpoint of step {checkpoint.step} is missing from storage; starting over.",
               level=TrainingEvent.Level.WARNING)
        _delete_checkpoints(job.pk)
        return None
    _event(job, f"Resuming from the checkpoint of step {checkpoint.step}.", data={"step": checkpoint.step})
    return target


def _delete_checkpoints(job_id: int) -> None:
    storage = get_storage()
    for checkpoint in Checkpoint.objects.filter(job_id=job_id):
        storage.delete_prefix(checkpoint.storage_prefix)
        checkpoint.delete()


# --- finishing ---------------------------------------------------------------------------------


def _artifact_prefix(job: TrainingJob, version: str) -> str:
    return artifact_prefix(tenant=job.tenant.slug, adapter=job.adapter_name, version=version)


def _artifact_source(job: TrainingJob, version: str) -> dict[str, Any] | None:
    """The `source` of the manifest published at the job's prefix for `version`, if any."""
    key = f"{_artifact_prefix(job, version)}/{MANIFEST_NAME}"
    storage = get_storage()
    if not storage.exists(key):
        return None
    try:
        return json.loads(storage.get_bytes(key)).get("source") or {}
    except ValueError:
        return {}


def _own_artifact(job: TrainingJob, version: str) -> bool:
    return _artifact_source(job, version) == {"kind": "training_job", "id": str(job.pk)}


def _assign_version(job: TrainingJob) -> str:
    """The version to publish, fixed on the job before anything is published (module docstring)."""
    with transaction.atomic():
        Tenant.objects.select_for_update().get(pk=job.tenant_id)
        current = TrainingJob.objects.get(pk=job.pk)
        if current.version:
            return current.version
        taken = set(AdapterVersion.objects.for_tenant(job.tenant)
                    .filter(adapter__name=job.adapter_name).values_list("version", flat=True))
        taken |= set(TrainingJob.objects.for_tenant(job.tenant).filter(adapter_name=job.adapter_name)
                     .exclude(version="").values_list("version", flat=True))
        version = version_next_patch(taken)
        # An artifact no row knows (an upload or job that failed half-way) also takes the number.
        while _artifact_source(job, version) is not None:
            taken.add(version)
            version = version_next_patch(taken)
        TrainingJob.objects.filter(pk=job.pk).update(version=version)
    job.version = version
    return version


def _publish_and_register(job: TrainingJob, token: str, adapter_dir: Path) -> None:
    version = _assign_version(job)
    prefix = _artifact_prefix(job, version)
    source = _artifact_source(job, version)
    if source is not None and source != {"kind": "training_job", "id": str(job.pk)}:
        raise JobFailure(f"Version {version} of adapter '{job.adapter_name}' was published by someone else while "
                         "the job ran; retry the job with another version.", code="version_exists")
    reused = source is not None
    if not reused:
        (adapter_dir / "README.md").unlink(missing_ok=True)  # PEFT's model card: not part of an artifact
        manifest_write(adapter_dir, tenant=job.tenant.slug, name=job.adapter_name, version=version,
                       base_model_name=settings.BASE_MODEL_NAME,
                       base_config_sha256=base_config_sha256(Path(settings.BASE_MODEL_PATH)),
                       source_kind="training_job", source_id=job.pk)
        get_storage().publish_directory(adapter_dir, prefix)
    _register(job, token, prefix, reused=reused)


def _register(job: TrainingJob, token: str, prefix: str, *, reused: bool) -> None:
    """Registers the published artifact and ends the job as succeeded, in one transaction.

    If that fails (or the job was cancelled meanwhile), the artifact is deleted: the job's artifact
    exists only together with its version.
    """
    try:
        with transaction.atomic():
            locked = TrainingJob.objects.select_for_update().get(pk=job.pk)
            if locked.lease_token != token:
                raise _LeaseLost()
            if locked.cancel_requested_at is not None:
                raise _CancelledLate()
            version = registry.adapter_version_register(
                tenant=job.tenant, adapter_name=job.adapter_name, version=job.version, artifact_prefix=prefix,
                training_job_id=str(job.pk),
            )
            locked.adapter_version = version
            _finish(locked, Status.SUCCEEDED, f"Job succeeded: adapter '{job.adapter_name}' version {job.version} "
                                              "is registered (status ready).", data={"version": job.version})
    except _LeaseLost:
        raise
    except _CancelledLate:
        get_storage().delete_prefix(prefix)
        _end_cancelled(job, token)
    except ServiceError as error:
        get_storage().delete_prefix(prefix)
        raise JobFailure(f"The trained adapter could not be registered: {error.message}", code=error.code) from None
    except BaseException:
        get_storage().delete_prefix(prefix)
        raise


class _CancelledLate(Exception):
    """Cancellation arrived after the last step but before registration."""


def _finish(job: TrainingJob, status: str, message: str, *, level: str = TrainingEvent.Level.INFO,
            data: dict[str, Any] | None = None) -> None:
    """Ends the (locked) job: final status, lease released, one event."""
    job.status = status
    job.finished_at = timezone.now()
    job.lease_token = ""
    job.estimated_finish = None
    job.save()
    _event(job, message, level=level, data=data)


def _end_cancelled(job: TrainingJob, token: str) -> None:
    with transaction.atomic():
        locked = TrainingJob.objects.select_for_update().get(pk=job.pk)
        if locked.lease_token == token and not locked.is_final:
            _finish(locked, Status.CANCELLED, f"Job cancelled at step {locked.step}; nothing was published.")
            _after_commit(partial(_delete_checkpoints, job.pk))


def _end_failed(job: TrainingJob, token: str, code: str, message: str) -> None:
    with transaction.atomic():
        locked = TrainingJob.objects.select_for_update().get(pk=job.pk)
        if locked.lease_token != token or locked.is_final:
            return
        locked.error_code, locked.error_message = code[:64], message
        if locked.version != locked.requested_version:
            # An assigned version was never registered (nothing of it is left in storage): a retry picks
            # a free one, rather than insisting on one that may have been taken meanwhile.
            locked.version = ""
        _finish(locked, Status.FAILED, message, level=TrainingEvent.Level.ERROR, data={"code": code})


def _event(job: TrainingJob, message: str, *, level: str = TrainingEvent.Level.INFO,
           type: str = TrainingEvent.Type.MESSAGE, data: dict[str, Any] | None = None) -> TrainingEvent:
    return TrainingEvent.objects.create(job=job, level=level, type=type, message=message, data=data or {})

