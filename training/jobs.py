"""Training jobs: creation (every input checked first), cancel, pause and resume, retry, and settling jobs
that waited for their files.

A created job waits for its turn, fairly between tenants, within its tenant's concurrent-job limit
(training.concurrency); beyond those a tenant may have TRAINING_MAX_WAITING_JOBS waiting, and more
is refused (LimitExceeded). A job created while its files are still being validated (OpenAI's
`validating_files`) is settled by `training_jobs_release` once they are.
"""

from __future__ import annotations

import random
from functools import partial
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from serving.contracts.errors import Conflict, InvalidInput, LimitExceeded, NotFound
from serving.registry import selectors as registry_selectors
from serving.registry.adapter_names import adapter_name_validate, adapter_room_check
from serving.registry.models import Adapter, AdapterVersion
from serving.registry.versions import version_parse
from tenants.models import Tenant
from training import conf
from training.base import (PENDING_DATASET_STATUSES, VERSION_RELEASED_STATUSES, Status, after_commit,
                           checkpoints_discard, event, finish, held_out, lease_fresh, pause)
from training.hyperparameters import Hyperparameters, fit_to_dataset, resolve_hyperparameters
from training.methods import dataset_problem
from training.models import Dataset, TrainingEvent, TrainingJob
from training.concurrency import counts_toward_limit, training_jobs_dispatch

MAX_SEED = 2**31 - 1
MAX_VALIDATION_FRACTION = 0.5
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


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


def _check_adapter_room(tenant: Tenant, name: str) -> None:
    """LimitExceeded (the registry's own rule) when `name` is a new adapter the tier has no room for.

    The job then holds that room until it ends (docs/training.md, "Adapter names"), so it fails
    here rather than at publishing, hours later. The caller holds the tenant's row lock.
    """
    if not Adapter.objects.for_tenant(tenant).filter(name=name).exists():
        adapter_room_check(tenant=tenant, name=name, param="adapter")


def _check_gpus(tenant: Tenant, hp: Hyperparameters) -> None:
    """InvalidInput when the job asks for more GPUs than the tenant's tier allows one job."""
    allowed = tenant.tier.max_gpus_per_job
    if hp.gpus > allowed:
        raise InvalidInput(f"Hyperparameter 'gpus' is {hp.gpus}, but tier '{tenant.tier.name}' allows at most {allowed} "
                           f"GPU(s) per training job (max_gpus_per_job); ask for {allowed} or fewer, or move to a "
                           "higher tier.", code="max_gpus_per_job_exceeded", param="hyperparameters.gpus")


def _check_requested_version(tenant: Tenant, adapter_name: str, version: Any) -> str:
    if version in (None, ""):
        return ""
    version_parse(version)
    taken = AdapterVersion.objects.for_tenant(tenant).filter(
        adapter__name=adapter_name, version=version).exists()
    reserved = TrainingJob.objects.for_tenant(tenant).filter(
        adapter_name=adapter_name, version=version).exclude(status__in=VERSION_RELEASED_STATUSES).exists()
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
    if (dataset.num_examples or 0) - held_out(dataset.num_examples or 0, value) < 1:
        raise InvalidInput(f"Dataset {dataset.pk} has {dataset.num_examples} example(s): too few to hold "
                           f"{value:.0%} out for validation.", param="validation_fraction")
    return float(value)


def _fitted(hp: Hyperparameters, num_examples: int, fraction: float) -> Hyperparameters:
    """`hp` with its "auto" values picked for the job's training examples (training.hyperparameters)."""
    return fit_to_dataset(hp, num_examples - held_out(num_examples, fraction), conf.limits())


def _method_problem(hp: Hyperparameters, files: tuple[tuple[Dataset | None, str], ...]) -> tuple[str, str] | None:
    """(error code, message) when a file is in a format the job's method does not train on."""
    for dataset, kind in files:
        problem = dataset_problem(hp.method, dataset.format) if dataset is not None else None
        if dataset is not None and problem is not None:
            return f"invalid_{kind}_file", f"The {kind} file (dataset {dataset.pk}) does not fit the job: {problem}"
    return None


def _planned_steps(num_examples: int, fraction: float, hp: Hyperparameters) -> int:
    """Steps the job will take (exact unless truncation leaves some examples nothing to learn)."""
    train = num_examples - held_out(num_examples, fraction)
    return -(-train // hp.batch_size) * hp.n_epochs


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
    """A queued job; it starts when its turn comes, within the tenant's concurrent-job limit (module docstring).

    Every input is checked first (datasets ready and the tenant's, adapter name and tier's adapter
    limit, version, hyperparameters against the platform limits and the tier's GPUs per job, base
    model, metadata, waiting-job limit); a refused job leaves nothing behind. With `await_validation`
    (OpenAI's behaviour) the files may still be being validated: the job waits for them
    (`training_jobs_release`) and fails if one turns out invalid.
    """
    hp = resolve_hyperparameters(hyperparameters, conf.limits())
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
        if not pending:
            mismatch = _method_problem(hp, ((dataset, "training"), (validation, "validation")))
            if mismatch is not None:
                raise InvalidInput(mismatch[1], code="dataset_format_mismatch",
                                   param="validation_file" if mismatch[0] == "invalid_validation_file" else
                                   "training_file")
            hp = _fitted(hp, dataset.num_examples or 0, fraction)
        _check_gpus(locked, hp)
        adapter_name_validate(adapter, param="adapter")
        _check_adapter_room(locked, adapter)
        requested = _check_requested_version(locked, adapter, version)
        _check_waiting_room(locked)
        job = TrainingJob.objects.create(
            tenant=locked, dataset=dataset, validation_dataset=validation, validation_fraction=fraction,
            adapter_name=adapter, version=requested, requested_version=requested,
            base_model=settings.BASE_MODEL_NAME, base_model_revision=settings.BASE_MODEL_REVISION,
            hyperparameters=hp.to_dict(), seed=seed, metadata=metadata,
            total_steps=None if pending else _planned_steps(dataset.num_examples or 0, fraction, hp),
        )
        examples = "its files are being validated" if pending else f"{dataset.num_examples} examples"
        event(job, f"Job created: adapter '{adapter}', {examples}, {hp.n_epochs} epoch(s).")
        after_commit(training_jobs_dispatch)
    return job


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
    it joins the queue again. Idempotent: a settled job is left as it is.
    """
    failed: list[int] = []
    settled = False
    waiting = TrainingJob.objects.filter(Q(dataset_id=dataset_id) | Q(validation_dataset_id=dataset_id),
                                         status=Status.QUEUED, dispatched_at__isnull=True)
    for job_id in waiting.values_list("pk", flat=True):
        with transaction.atomic():
            job = (TrainingJob.objects.select_for_update(of=("self",))
                   .select_related("dataset", "validation_dataset").filter(pk=job_id, status=Status.QUEUED).first())
            if job is None or _files_pending(job.dataset, job.validation_dataset):
                continue
            hp = Hyperparameters.from_dict(job.hyperparameters)
            problem = _invalid_file(job) or _method_problem(hp, ((job.dataset, "training"),
                                                                 (job.validation_dataset, "validation")))
            if problem is None and job.total_steps is None and job.dataset is not None:
                hp = _fitted(hp, job.dataset.num_examples or 0, job.validation_fraction)
                job.hyperparameters = hp.to_dict()
                job.total_steps = _planned_steps(job.dataset.num_examples or 0, job.validation_fraction, hp)
                job.save(update_fields=["hyperparameters", "total_steps"])
                event(job, f"Files validated: {job.dataset.num_examples} training examples.")
            if problem is not None:
                job.error_code, job.error_message = problem
                finish(job, Status.FAILED, job.error_message, level=TrainingEvent.Level.ERROR,
                       data={"code": job.error_code})
                failed.append(job.pk)
            settled = True
    if settled:
        after_commit(training_jobs_dispatch)
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
    concurrent = tenant.tier.max_concurrent_training_jobs
    holding = jobs.filter(counts_toward_limit()).count()
    waiting = jobs.filter(status=Status.QUEUED, dispatched_at__isnull=True).count()
    limit = conf.setting_int("TRAINING_MAX_WAITING_JOBS")
    if holding >= concurrent and waiting >= limit:
        raise LimitExceeded(
            f"Tenant '{tenant.slug}' is at its training job limit: {holding} job(s) running (tier "
            f"'{tenant.tier.name}' allows {concurrent} at a time) and {waiting} waiting (at most {limit}). Wait for "
            "a job to finish or cancel one.", code="training_job_limit_reached",
        )


def training_job_cancel(*, job: TrainingJob) -> TrainingJob:
    """Cancels a queued job at once; a running one stops before its next step (no artifact is kept)."""
    with transaction.atomic():
        job = TrainingJob.objects.select_for_update().get(pk=job.pk)
        if job.is_final:
            raise Conflict(f"Training job {job.pk} has already {job.status}; only queued, running or paused jobs can "
                           "be cancelled.", code="job_finished")
        if job.cancel_requested_at is None:
            job.cancel_requested_at = timezone.now()
            job.save(update_fields=["cancel_requested_at"])
        if not lease_fresh(job):
            # Queued, or its worker is gone: no run will see the request, so it ends here.
            finish(job, Status.CANCELLED, "Job cancelled.")
            checkpoints_discard(job.pk)
            after_commit(training_jobs_dispatch)
        else:
            event(job, "Cancellation requested; the job stops before its next step.")
    return job


def training_job_pause(*, job: TrainingJob) -> TrainingJob:
    """Pauses a job: a waiting one at once; a running one saves a checkpoint and pauses before its next step.

    A paused job does not count toward the tenant's concurrent-job limit, so the next waiting job
    starts. Asking again while the pause is under way changes nothing. An ended job, or one being
    cancelled, is refused (InvalidInput: OpenAI answers 400).
    """
    with transaction.atomic():
        job = TrainingJob.objects.select_for_update().get(pk=job.pk)
        if job.is_final:
            raise InvalidInput(f"Training job {job.pk} has already {job.status}; only queued or running jobs can be "
                               "paused.", code="job_not_pausable")
        if job.cancel_requested_at is not None:
            raise InvalidInput(f"Training job {job.pk} is being cancelled; it cannot be paused.",
                               code="job_not_pausable")
        if job.status == Status.PAUSED or job.pause_requested_at is not None:
            return job
        if lease_fresh(job):
            job.pause_requested_at = timezone.now()
            job.save(update_fields=["pause_requested_at"])
            event(job, "Pause requested; the job saves a checkpoint and pauses before its next step.")
        else:
            # Waiting, or its worker is gone (its run, if it comes back, finds its lease taken and stops).
            pause(job)
            after_commit(training_jobs_dispatch)
    return job


def training_job_resume(*, job: TrainingJob) -> TrainingJob:
    """Queues a paused job again; it resumes from its newest checkpoint once the tenant's limit has room.

    A resume asked before a requested pause took effect withdraws the pause. Anything else that is
    not paused is refused (InvalidInput), and so is a resume beyond TRAINING_MAX_WAITING_JOBS.
    """
    with transaction.atomic():
        job = TrainingJob.objects.select_for_update().get(pk=job.pk)
        if job.status != Status.PAUSED:
            if job.pause_requested_at is not None and not job.is_final:
                job.pause_requested_at = None
                job.save(update_fields=["pause_requested_at"])
                event(job, "Resumed before the pause took effect; the job goes on.")
                return job
            raise InvalidInput(f"Training job {job.pk} is {job.status}, not paused; only a paused job can be resumed.",
                               code="job_not_paused")
        # Locked after the job, in the order publishing locks them (a job, then its tenant).
        _check_waiting_room(Tenant.objects.select_for_update(of=("self",)).select_related("tier")
                            .get(pk=job.tenant_id))
        job.status = Status.QUEUED
        job.save(update_fields=["status"])
        where = f"the checkpoint of step {job.step}" if job.step else "the start"
        event(job, f"Job resumed; it goes on from {where} once the tenant's concurrent-job limit has room.",
              data={"step": job.step})
        if job.total_steps is None and job.dataset_id is not None:
            # Paused while its files were validated: settle it now (steps planned, or failed on a bad file).
            training_jobs_release(dataset_id=job.dataset_id)
        after_commit(training_jobs_dispatch)
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
        # Locked after the job, in the order publishing locks them (a job, then its tenant).
        _check_adapter_room(Tenant.objects.select_for_update(of=("self",)).select_related("tier")
                            .get(pk=job.tenant_id), job.adapter_name)
        job.status = Status.QUEUED
        job.error_code = job.error_message = ""
        job.dispatched_at = job.cancel_requested_at = job.finished_at = job.heartbeat_at = None
        job.lease_token = ""
        resume = job.checkpoints.first()
        job.step = resume.step if resume else 0
        job.save()
        event(job, "Job retried" + (f"; it resumes from step {resume.step}." if resume else "."))
        after_commit(training_jobs_dispatch)
    return job
