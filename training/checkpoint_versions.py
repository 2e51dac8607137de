"""Deploying a training job's kept checkpoint as a version of its adapter (docs/registry.md,
"Versions from checkpoints"). Training's, not the registry's: it reads jobs and checkpoints, which
serving never imports, and asks the registry to register the version as any job's.

The checkpoint's artifact (training.checkpoint_artifacts) is fetched and verified against the digest
its row recorded, then published again under `adapters/<tenant>/<adapter>/<version>/` by training's
one artifact writer (training.publishing.artifact_publish): the same files, byte for byte, with a
manifest naming the version, and the job as its source. The registry registers it as it registers a
job's version (serving.registry.services.adapter_version_register: verified again, one audited `register`
event), and the version records the checkpoint's step beside its job (`source_id`). A version is a
copy, so the checkpoint's retention never takes a version's weights with it. All or nothing: if the
registration fails, the published copy is deleted.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from django.db import transaction

from serving.contracts.artifact import MANIFEST_NAME, AdapterError, adapter_digest, manifest_verify
from serving.contracts.errors import Conflict, InvalidInput, NotFound
from serving.registry import services as registry
from serving.registry.models import AdapterVersion, artifact_prefix
from serving.registry.storage import get_storage
from serving.registry.versions import version_next_patch, version_parse
from training.base import VERSION_RELEASED_STATUSES
from training.models import Checkpoint, TrainingJob
from training.publishing import artifact_publish


def checkpoint_version_create(*, checkpoint: Checkpoint, actor: str, version: str | None = None,
                              reason: str = "") -> AdapterVersion:
    """A new version (status ready) of the job's adapter holding the checkpoint's adapter; `version`
    defaults to the next patch release that neither a version nor a job of the adapter holds."""
    job = TrainingJob.objects.select_related("tenant").get(pk=checkpoint.job_id)
    what = f"The checkpoint of step {checkpoint.step} of job ftjob-{job.pk}"
    if not checkpoint.artifact_uri:
        raise InvalidInput(f"{what} was saved before checkpoints were servable: it has no adapter artifact to deploy.",
                           code="checkpoint_not_servable")
    chosen = _version_choose(job, version)
    storage = get_storage()
    workspace = Path(tempfile.mkdtemp(prefix="loraplex-checkpoint-"))
    published: str | None = None
    try:
        directory = workspace / "adapter"
        try:
            storage.download_prefix(checkpoint.artifact_prefix, directory, flat=True)
        except NotFound:
            raise NotFound(f"{what} is no longer stored (a newer one replaced it).",
                           code="checkpoint_not_found") from None
        try:
            manifest_verify(directory)
        except AdapterError as error:
            raise InvalidInput(f"{what} fails verification: {error}", code="artifact_corrupt") from None
        if adapter_digest(directory) != checkpoint.manifest_sha256:
            raise InvalidInput(f"{what} has a manifest other than the one recorded when it was saved.",
                               code="artifact_corrupt")
        (directory / MANIFEST_NAME).unlink()  # the writer writes the version's own
        prefix = _prefix(job, chosen)
        artifact_publish(directory, prefix, job=job, version=chosen)
        published = prefix
        with transaction.atomic():
            created = registry.adapter_version_register(
                tenant=job.tenant, adapter_name=job.adapter_name, version=chosen, artifact_prefix=prefix,
                training_job_id=str(job.pk), base_model_revision=job.base_model_revision, actor=actor,
                reason=reason or f"From the checkpoint of step {checkpoint.step} of fine-tuning job ftjob-{job.pk}.",
            )
            AdapterVersion.objects.filter(pk=created.pk).update(source_checkpoint_step=checkpoint.step)
        created.source_checkpoint_step = checkpoint.step
        return created
    except BaseException:
        if published is not None:
            storage.delete_prefix(published)
        raise
    finally:
        shutil.rmtree(workspace, ignore_errors=True)


def _taken(job: TrainingJob, version: str) -> Conflict:
    return Conflict(f"Adapter '{job.adapter_name}' already has (or a job is producing) version {version}; versions "
                    "are immutable, so choose another or leave it out for the next patch.", code="version_exists",
                    param="version")


def _version_choose(job: TrainingJob, requested: str | None) -> str:
    """The requested version if free, or the next patch; a version a job will publish is not free."""
    versions = set(AdapterVersion.objects.filter(adapter__tenant_id=job.tenant_id, adapter__name=job.adapter_name)
                   .values_list("version", flat=True))
    versions |= set(TrainingJob.objects.filter(tenant_id=job.tenant_id, adapter_name=job.adapter_name)
                    .exclude(version="").exclude(status__in=VERSION_RELEASED_STATUSES).values_list("version", flat=True))
    stored = get_storage()
    if not requested:
        chosen = version_next_patch(versions)
        # An artifact no row knows (an upload or job that failed half-way) also takes the number.
        while stored.exists(f"{_prefix(job, chosen)}/{MANIFEST_NAME}"):
            versions.add(chosen)
            chosen = version_next_patch(versions)
        return chosen
    version_parse(requested)
    if requested in versions or stored.exists(f"{_prefix(job, requested)}/{MANIFEST_NAME}"):
        raise _taken(job, requested)
    return requested


def _prefix(job: TrainingJob, version: str) -> str:
    return artifact_prefix(tenant=job.tenant.slug, adapter=job.adapter_name, version=version)
