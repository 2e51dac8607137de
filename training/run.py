"""The run of one job on a worker: its lease, heartbeat, the trainer's hooks, checkpoints, how it ends.

Redelivery. Celery may deliver a job's task again (a killed worker, the visibility timeout). A
delivery must hold the job's lease to run it: `training_job_claim` grants it when no other run's
heartbeat is fresh, so two runs never train one job at once, and a later run resumes from the last
checkpoint. What the run publishes is idempotent too (training.publishing).

A clean stop. When its worker stops (training.worker_stop), a run stops before its next step, saves
a checkpoint of the steps done, releases the lease, marks the job `interrupted_at` and has its task
sent again (`Claim.retry_in` 0): the next worker claims it at once instead of waiting for the lease
to expire, and resumes from that checkpoint.

A pause (training.jobs.training_job_pause) takes the same path: the run stops before its next step
and saves a checkpoint, but then pauses the job (training.base.pause) instead of sending its task
again; a resume queues it, and its next run resumes from that checkpoint.

The run never imports the job lifecycle (training.jobs): it ends the job itself, and asks
training.concurrency to start the next one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from serving.contracts.errors import NotFound
from serving.registry.storage import get_storage
from serving.contracts.artifact import base_config_sha256
from training import conf
from training.base import (JobFailure, LeaseLost, Status, after_commit, checkpoints_delete, checkpoints_discard, event,
                           finish, held_out, lease_age, lease_seconds, pause)
from training.examples import EncodingError
from training.hyperparameters import Hyperparameters
from training.methods import encode_lines
from training.models import Checkpoint, Dataset, TrainingEvent, TrainingJob
from training.pace import Pace
from training.preference import TrainItem
from training.publishing import CancelledLate, artifact_prefix_of, own_artifact, publish_and_register, register
from training.scratch import scratch_create
from training.checkpoint_artifacts import checkpoint_store
from training.concurrency import training_jobs_dispatch
from training.validation import iter_lines
from training.worker_stop import stop_requested

logger = logging.getLogger(__name__)

# A job is saved no more often than this while it runs (metrics events are separate).
PROGRESS_INTERVAL_SECONDS = 1.0


@dataclass(frozen=True)
class Claim:
    """The outcome of asking for a job's lease: a token to run with, or why not (and when to ask again)."""

    job: TrainingJob | None
    token: str = ""
    retry_in: float | None = None
    reason: str = ""


def training_job_claim(*, job_id: int) -> Claim:
    """The lease of a job for this delivery, if the job still needs a run and no live run holds it."""
    with transaction.atomic():
        job = TrainingJob.objects.select_for_update(of=("self",)).select_related("tenant").filter(pk=job_id).first()
        if job is None:
            return Claim(None, reason="the job no longer exists")
        if job.is_final:
            return Claim(None, reason=f"the job has already {job.status}")
        if job.status == Status.PAUSED:
            return Claim(None, reason="the job is paused")
        age = lease_age(job)
        if age is not None and age < lease_seconds():
            return Claim(None, retry_in=max(1.0, lease_seconds() - age), reason="another run holds the job")
        if job.cancel_requested_at is not None:
            finish(job, Status.CANCELLED, "Job cancelled.")
            checkpoints_discard(job.pk)
            after_commit(training_jobs_dispatch)
            return Claim(None, reason="the job was cancelled")
        if job.pause_requested_at is not None:
            # Asked of a run that stopped reporting before it could pause: the job pauses here.
            pause(job)
            after_commit(training_jobs_dispatch)
            return Claim(None, reason="the job was paused")
        lost = job.status == Status.RUNNING
        interrupted = job.interrupted_at is not None
        token = secrets.token_hex(16)
        now = timezone.now()
        job.lease_token, job.heartbeat_at = token, now
        job.attempts += 1
        job.status = Status.RUNNING
        job.started_at = job.started_at or now
        job.dispatched_at = job.dispatched_at or now
        job.interrupted_at = None
        job.save()
        if interrupted:
            event(job, f"A worker takes the job back after the clean stop; attempt {job.attempts} resumes it.")
        elif lost:
            event(job, f"The previous worker stopped reporting; attempt {job.attempts} takes over.",
                  level=TrainingEvent.Level.WARNING)
        else:
            event(job, f"Training started (attempt {job.attempts}).")
        # A task taken from the queue: the next job in turn is sent (training.concurrency).
        after_commit(training_jobs_dispatch)
    return Claim(job, token=token)


def training_job_run(*, job_id: int) -> Claim:
    """Runs a job to its end for this delivery (the Celery task's body); returns the claim it got.

    A claim without a job means there is nothing to do now (finished, cancelled, or held by a
    live run, in which case `retry_in` says when to look again). A claim with a job and `retry_in`
    is a run that gave the job back because its worker is stopping: the task is sent again at once.
    """
    if stop_requested():
        # Delivered as the worker stops: leave the job to the next worker.
        return Claim(None, retry_in=0.0, reason="this worker is stopping")
    claim = training_job_claim(job_id=job_id)
    if claim.job is None:
        return claim
    job = claim.job
    workspace = scratch_create(job.pk)
    try:
        with _heartbeat(job.pk, claim.token):
            _run_claimed(job, claim.token, workspace)
    except _Interrupted as interruption:
        if _release_interrupted(job, claim.token, interruption.step):
            # Sent again at once: the next worker takes the job as soon as it runs.
            claim = Claim(job, token=claim.token, retry_in=0.0, reason="the worker stopped cleanly")
    except LeaseLost:
        logger.warning("Training job %s was taken over by another run; this run stops", job.pk)
    except CancelledLate:
        _end_cancelled(job, claim.token)
    except JobFailure as failure:
        _end_failed(job, claim.token, failure.code, failure.message)
    except Exception as error:
        logger.exception("Training job %s failed", job.pk)
        _end_failed(job, claim.token, "internal_error",
                    f"Training failed unexpectedly ({type(error).__name__}: {error}). Retry the job; if it fails "
                    "again, contact the platform operator.")
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
        training_jobs_dispatch()
    return claim


@contextmanager
def _heartbeat(job_id: int, token: str) -> Iterator[None]:
    """Refreshes the lease from a thread, so a long step (or a slow upload) never looks like a dead worker."""
    stop = threading.Event()
    interval = max(0.5, lease_seconds() / 4)

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


class _Interrupted(Exception):
    """The run stopped for its worker's stop; `step` is what the newest checkpoint holds (0: none)."""

    def __init__(self, step: int) -> None:
        super().__init__(f"interrupted at step {step}")
        self.step = step


def _run_claimed(job: TrainingJob, token: str, workspace: Path) -> None:
    from training.ranks import RunInputs, trainer_base, world_size
    from training.trainer import TrainingInterrupted, TrainingSetupError, TrainingStopped, load_tokenizer

    if job.version and own_artifact(job, job.version):
        event(job, f"Version {job.version} was already published by an earlier attempt; registering it.")
        register(job, token, artifact_prefix_of(job, job.version))
        return
    dataset = job.dataset
    if dataset is None:
        raise JobFailure("The job's dataset was deleted; create a new job.", code="dataset_not_found")
    if job.base_model_revision != settings.BASE_MODEL_REVISION:
        # Its checkpoints and its recorded revision belong to the base it was created on.
        raise JobFailure(f"The job was created on revision {job.base_model_revision or '(a local directory)'} of "
                         f"base model '{job.base_model}', but this worker has revision "
                         f"{settings.BASE_MODEL_REVISION or '(a local directory)'}; create a new job.",
                         code="base_model_revision_mismatch")
    base_path = str(settings.BASE_MODEL_PATH)
    hp = Hyperparameters.from_dict(job.hyperparameters)
    train, valid = _load_examples(job, dataset, hp, load_tokenizer(base_path), workspace)
    inputs = RunInputs(base_path=base_path, hyperparameters=job.hyperparameters, seed=job.seed, train=train,
                       valid=valid, fingerprint=_fingerprint(job), base_model_name=settings.BASE_MODEL_NAME,
                       checkpoint_every=conf.setting_int("TRAINING_CHECKPOINT_EVERY_STEPS"),
                       log_every=conf.setting_int("TRAINING_LOG_EVERY_STEPS"))
    size = world_size(hp.gpus)
    if size != hp.gpus:
        event(job, f"The job asks for {hp.gpus} GPUs; this worker has {size}, and trains it on those (same batches, "
                   "same checkpoints).", level=TrainingEvent.Level.WARNING)
    hooks = _JobHooks(job, token)
    try:
        with trainer_base(inputs, size) as (base, world):
            trainer = inputs.trainer(base, hooks, workspace / "run", world,
                                     should_interrupt=lambda: stop_requested() or hooks.pause_requested)
            resume = _fetch_checkpoint(job, workspace)
            if resume is not None and not trainer.resumable(resume):
                event(job, "The last checkpoint does not match this job's data or settings; starting over.",
                      level=TrainingEvent.Level.WARNING)
                checkpoints_delete(job.pk)
                resume = None
            result = trainer.run(resume_from=resume)
    except TrainingSetupError as error:
        raise JobFailure(str(error), code="invalid_training_setup") from None
    except TrainingStopped:
        hooks.raise_if_lease_lost()
        _end_cancelled(job, token)
        return
    except TrainingInterrupted as interruption:
        if interruption.__cause__ is not None:
            logger.warning("Training job %s: no checkpoint could be saved on the worker's stop; it resumes from "
                           "step %s", job.pk, interruption.step, exc_info=interruption.__cause__)
        raise _Interrupted(interruption.step) from None
    publish_and_register(job, token, result.adapter_dir)


def _load_examples(job: TrainingJob, dataset: Dataset, hp: Hyperparameters, tokenizer: Any,
                   workspace: Path) -> tuple[list[TrainItem], list[TrainItem]]:
    """The job's training and held-out examples (DPO's pairs), encoded; JobFailure when none has tokens to learn."""
    def encoded(source: Dataset) -> list[TrainItem]:
        path = get_storage().download(source.storage_key, workspace / f"dataset-{source.pk}.jsonl")
        try:
            with path.open("rb") as stream:
                return encode_lines(iter_lines(stream), source.format, hp, tokenizer)
        except (ValueError, EncodingError) as error:
            raise JobFailure(f"Dataset {source.pk} cannot be trained on: {error}.", code="dataset_unusable") from None

    examples = encoded(dataset)
    if job.validation_dataset is not None:
        train, valid = examples, encoded(job.validation_dataset)
    else:
        order = list(range(len(examples)))
        random.Random(job.seed).shuffle(order)
        held = set(order[:held_out(len(examples), job.validation_fraction)])
        train = [example for index, example in enumerate(examples) if index not in held]
        valid = [example for index, example in enumerate(examples) if index in held]
    usable = [example for example in train if example.num_trained_tokens]
    truncated = sum(example.truncated for example in train)
    if truncated:
        event(job, f"{truncated} example(s) are longer than max_seq_length ({hp.max_seq_length}) and were "
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
        # Read with the cancel request before every step (should_stop), which the trainer checks first.
        self.pause_requested = False
        self.pace = Pace()
        self.last_saved = 0.0
        self.pending: dict[str, Any] = {}

    def _mine(self) -> Any:
        return TrainingJob.objects.filter(pk=self.job.pk, lease_token=self.token)

    def should_stop(self) -> bool:
        row = (TrainingJob.objects.filter(pk=self.job.pk)
               .values("lease_token", "cancel_requested_at", "pause_requested_at").first())
        self.lease_lost = row is None or row["lease_token"] != self.token
        self.pause_requested = row is not None and row["pause_requested_at"] is not None
        return row is None or self.lease_lost or row["cancel_requested_at"] is not None

    def raise_if_lease_lost(self) -> None:
        if self.lease_lost:
            raise LeaseLost()

    def on_step(self, step: int, total_steps: int, epoch: float, trained_tokens: int) -> None:
        self.pace.step_ended(step=step, trained_tokens=trained_tokens, now=timezone.now())
        self.pending = {"step": step, "total_steps": total_steps, "epoch": epoch, "trained_tokens": trained_tokens,
                        "estimated_finish": self.pace.estimated_finish(total_steps)}
        if time.monotonic() - self.last_saved >= PROGRESS_INTERVAL_SECONDS or step == total_steps:
            self.last_saved = time.monotonic()
            self._save_progress()

    def _save_progress(self) -> None:
        if self.pending and not self._mine().update(**self.pending):
            self.lease_lost = True
            raise LeaseLost()

    def on_log(self, metrics: Any) -> None:
        rate = self.pace.tokens_per_second()
        data = metrics.to_dict() | ({"tokens_per_second": round(rate, 1)} if rate is not None else {})
        self._mine().update(train_loss=metrics.train_loss,
                            **({"valid_loss": metrics.valid_loss} if metrics.valid_loss is not None else {}))
        valid = f", valid loss {metrics.valid_loss:.4f}" if metrics.valid_loss is not None else ""
        event(self.job, f"Step {metrics.step}/{metrics.total_steps}: train loss {metrics.train_loss:.4f}{valid}",
              type=TrainingEvent.Type.METRICS, data=data)

    def on_checkpoint(self, step: int, directory: Path, metrics: dict[str, Any]) -> None:
        from training.trainer import STATE_FILE

        # The state and, beside it, the step's adapter as a servable artifact (training.checkpoint_artifacts).
        stored = checkpoint_store(self.job, step, directory, marker=STATE_FILE)
        Checkpoint.objects.update_or_create(job=self.job, step=step, defaults={
            "storage_prefix": stored.storage_prefix, "metrics": metrics, "artifact_uri": stored.artifact_uri,
            "manifest_sha256": stored.manifest_sha256})
        event(self.job, f"Checkpoint saved at step {step}.", data={"step": step})
        kept = conf.setting_int("TRAINING_CHECKPOINTS_KEPT")
        storage = get_storage()
        for old in Checkpoint.objects.filter(job=self.job).order_by("-step")[max(1, kept):]:
            for prefix in old.storage_prefixes:
                storage.delete_prefix(prefix)
            old.delete()


def _fetch_checkpoint(job: TrainingJob, workspace: Path) -> Path | None:
    checkpoint = Checkpoint.objects.filter(job=job).order_by("-step").first()
    if checkpoint is None:
        return None
    target = workspace / f"resume-{checkpoint.step}"
    try:
        get_storage().download_prefix(checkpoint.storage_prefix, target)
    except NotFound:
        event(job, f"Checkpoint of step {checkpoint.step} is missing from storage; starting over.",
              level=TrainingEvent.Level.WARNING)
        checkpoints_delete(job.pk)
        return None
    event(job, f"Resuming from the checkpoint of step {checkpoint.step}.", data={"step": checkpoint.step})
    return target


def _release_interrupted(job: TrainingJob, token: str, step: int) -> bool:
    """Gives the job back after a clean stop: no lease (the next claim is granted at once), the task
    counted as sent now (the sweep re-sends it two leases on if it was lost), and the job says why.
    A job whose pause was asked is paused instead (its task is not sent again). True: send it again."""
    with transaction.atomic():
        locked = TrainingJob.objects.select_for_update().get(pk=job.pk)
        if locked.lease_token != token or locked.is_final:
            return False
        if locked.pause_requested_at is not None:
            pause(locked)
            return False
        now = timezone.now()
        locked.lease_token, locked.interrupted_at, locked.dispatched_at = "", now, now
        locked.estimated_finish = None
        locked.save(update_fields=["lease_token", "interrupted_at", "dispatched_at", "estimated_finish"])
        resume = f"the checkpoint of step {step}" if step else "the start"
        event(locked, f"The worker stopped at step {step}; the job resumes from {resume} on the next worker.",
              data={"step": step})
    return True


def _end_cancelled(job: TrainingJob, token: str) -> None:
    with transaction.atomic():
        locked = TrainingJob.objects.select_for_update().get(pk=job.pk)
        if locked.lease_token == token and not locked.is_final:
            finish(locked, Status.CANCELLED, f"Job cancelled at step {locked.step}; nothing was published.")
            checkpoints_discard(job.pk)


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
        finish(locked, Status.FAILED, message, level=TrainingEvent.Level.ERROR, data={"code": code})
