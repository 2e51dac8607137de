"""Publishing a trained adapter: its version, its artifact in storage, its registration, all or nothing.

Finishing is idempotent: the version is fixed on the job before publishing, an artifact an earlier
delivery of the same job published is reused, and the job's link to its AdapterVersion
(one-to-one) is written in the same transaction as the registration.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction

from serving.contracts.errors import ServiceError
from serving.registry.storage import get_storage
from serving.registry import services as registry
from serving.contracts.artifact import MANIFEST_NAME, adapter_digest, base_config_sha256, manifest_write
from serving.registry.models import AdapterVersion, artifact_prefix
from serving.registry.versions import version_next_patch
from tenants.models import Tenant
from training.base import JobFailure, LeaseLost, Status, finish
from training.models import TrainingJob


class CancelledLate(Exception):
    """Cancellation arrived after the last step but before registration; nothing was kept."""


def artifact_prefix_of(job: TrainingJob, version: str) -> str:
    """Where the job's artifact of `version` is published (the registry's layout)."""
    return artifact_prefix(tenant=job.tenant.slug, adapter=job.adapter_name, version=version)


def _artifact_source(job: TrainingJob, version: str) -> dict[str, Any] | None:
    """The `source` of the manifest published at the job's prefix for `version`, if any."""
    key = f"{artifact_prefix_of(job, version)}/{MANIFEST_NAME}"
    storage = get_storage()
    if not storage.exists(key):
        return None
    try:
        return json.loads(storage.get_bytes(key)).get("source") or {}
    except ValueError:
        return {}


def own_artifact(job: TrainingJob, version: str) -> bool:
    """True when the artifact published for `version` is this job's (an earlier delivery published it)."""
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


def publish_and_register(job: TrainingJob, token: str, adapter_dir: Path) -> None:
    """Publishes the trained adapter under the job's version and registers it (register)."""
    version = _assign_version(job)
    prefix = artifact_prefix_of(job, version)
    source = _artifact_source(job, version)
    if source is not None and source != {"kind": "training_job", "id": str(job.pk)}:
        raise JobFailure(f"Version {version} of adapter '{job.adapter_name}' was published by someone else while "
                         "the job ran; retry the job with another version.", code="version_exists")
    if source is None:
        artifact_publish(adapter_dir, prefix, job=job, version=version)
    register(job, token, prefix)


def artifact_publish(adapter_dir: Path, prefix: str, *, job: TrainingJob, version: str) -> str:
    """Publishes a PEFT directory the job trained as an artifact at `prefix`: its manifest (naming the
    job's tenant and adapter, `version`, the base model and the job as source) written into it, then
    the whole directory at once. Returns the manifest's sha256, the artifact's content digest.

    The one writer of trained artifacts: the job's version, each kept checkpoint's artifact
    (training.checkpoint_artifacts) and a version made from a checkpoint (training.checkpoint_versions).
    """
    (adapter_dir / "README.md").unlink(missing_ok=True)  # PEFT's model card: not part of an artifact
    manifest_write(adapter_dir, tenant=job.tenant.slug, name=job.adapter_name, version=version,
                   base_model_name=settings.BASE_MODEL_NAME,
                   base_config_sha256=base_config_sha256(Path(settings.BASE_MODEL_PATH)),
                   source_kind="training_job", source_id=job.pk)
    get_storage().publish_directory(adapter_dir, prefix)
    return adapter_digest(adapter_dir)


def register(job: TrainingJob, token: str, prefix: str) -> None:
    """Registers the published artifact and ends the job as succeeded, in one transaction.

    If that fails (or the job was cancelled meanwhile: CancelledLate, for the run to end the job),
    the artifact is deleted: the job's artifact exists only together with its version.
    """
    try:
        with transaction.atomic():
            locked = TrainingJob.objects.select_for_update().get(pk=job.pk)
            if locked.lease_token != token:
                raise LeaseLost()
            if locked.cancel_requested_at is not None:
                raise CancelledLate()
            version = registry.adapter_version_register(
                tenant=job.tenant, adapter_name=job.adapter_name, version=job.version, artifact_prefix=prefix,
                training_job_id=str(job.pk), base_model_revision=job.base_model_revision,
            )
            locked.adapter_version = version
            finish(locked, Status.SUCCEEDED, f"Job succeeded: adapter '{job.adapter_name}' version {job.version} "
                                             "is registered (status ready).", data={"version": job.version})
    except LeaseLost:
        raise
    except ServiceError as error:
        get_storage().delete_prefix(prefix)
        raise JobFailure(f"The trained adapter could not be registered: {error.message}", code=error.code) from None
    except BaseException:
        get_storage().delete_prefix(prefix)
        raise

