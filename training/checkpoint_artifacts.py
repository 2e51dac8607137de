"""Storing a kept checkpoint: its training state (what a run resumes from) and, beside it, its adapter
as a servable artifact, the same directory and manifest as a published version's (docs/training.md,
"Checkpoints").

The artifact is written by training.publishing's one writer (`artifact_publish`), on a thread of its
own while the run stores the state, so the training loop waits for the larger of the two uploads
(the state holds the same weights plus the optimizer's two moments, so the state's) and not for
their sum. Either both are stored or neither: a failure of one deletes the other.

The artifact's manifest names the job's tenant and adapter with the checkpoint's label
(serving.contracts.checkpoint_names.checkpoint_label) as its version. Nothing here touches the database: the
run records the returned URI and digest on the checkpoint's row.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from serving.contracts.artifact import ADAPTER_CONFIG_NAME
from serving.engine.lora.reader import WEIGHTS_NAME
from serving.registry.storage import get_storage
from serving.contracts.checkpoint_names import checkpoint_label
from training.models import Checkpoint, TrainingJob
from training.publishing import artifact_publish

# What of a checkpoint's directory is the adapter (PEFT's two files); the rest is the trainer's state.
ADAPTER_FILES = (ADAPTER_CONFIG_NAME, WEIGHTS_NAME)


@dataclass(frozen=True)
class StoredCheckpoint:
    """Where a checkpoint went: its state's prefix, and its artifact's URI and manifest digest."""

    storage_prefix: str
    artifact_uri: str
    manifest_sha256: str


def checkpoint_prefix(job: TrainingJob, step: int) -> str:
    """The storage prefix of the job's checkpoint at `step` (its artifact is at Checkpoint.artifact_prefix)."""
    return f"checkpoints/{job.tenant.slug}/{job.pk}/step-{step:08d}"


def checkpoint_store(job: TrainingJob, step: int, directory: Path, *, marker: str) -> StoredCheckpoint:
    """Stores the checkpoint the trainer wrote in `directory` (complete once `marker` is stored) and
    its adapter as an artifact, both at once (module docstring). Debris of a run killed while it
    stored this very step is replaced."""
    row = Checkpoint(job=job, step=step, storage_prefix=checkpoint_prefix(job, step))
    storage = get_storage()
    for prefix in row.storage_prefixes:
        storage.delete_prefix(prefix)
    staged = directory.with_name(f"{directory.name}-adapter")
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"checkpoint-{job.pk}-{step}") as pool:
        try:
            _stage(directory, staged)
            artifact = pool.submit(artifact_publish, staged, row.artifact_prefix, job=job,
                                   version=checkpoint_label(job.pk, step))
            try:
                storage.publish_directory(directory, row.storage_prefix, marker=marker)
            finally:
                # Waited for either way: the artifact is deleted below only once nothing writes it.
                digest = artifact.result()
        except BaseException:
            for prefix in row.storage_prefixes:
                storage.delete_prefix(prefix)
            raise
        finally:
            shutil.rmtree(staged, ignore_errors=True)
    return StoredCheckpoint(storage_prefix=row.storage_prefix, artifact_uri=storage.uri(row.artifact_prefix) + "/",
                            manifest_sha256=digest)


def _stage(directory: Path, staged: Path) -> None:
    """The adapter's files of the checkpoint, in a directory of their own (linked, not copied, where
    the file system allows), for the writer to add its manifest to."""
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir()
    for name in ADAPTER_FILES:
        try:
            (staged / name).hardlink_to(directory / name)
        except OSError:
            shutil.copyfile(directory / name, staged / name)
