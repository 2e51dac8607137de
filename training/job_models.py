"""Training's answer to serving about its jobs' models (serving.registry.job_models, registered in
training.apps): the job a name names and the checkpoints it keeps, read from training's models so
serving never imports them. A checkpoint is a model only while it is kept with its adapter artifact
(saved before checkpoints were servable: not one)."""

from __future__ import annotations

from serving.registry.job_models import CheckpointRecord, JobRecord
from training.models import Checkpoint, TrainingJob


class TrainingJobModels:
    def job(self, *, tenant_id: int, job_id: int, adapter: str) -> JobRecord | None:
        job = (TrainingJob.objects.filter(tenant_id=tenant_id, pk=job_id, adapter_name=adapter)
               .select_related("adapter_version").first())
        if job is None:
            return None
        return JobRecord(job_id=job.pk, adapter=job.adapter_name, base_model=job.base_model,
                         base_model_revision=job.base_model_revision, version=job.adapter_version)

    def checkpoint(self, *, job_id: int, step: int) -> CheckpointRecord | None:
        checkpoint = (Checkpoint.objects.filter(job_id=job_id, step=step).exclude(artifact_uri="")
                      .select_related("job").first())
        return None if checkpoint is None else _record(checkpoint)

    def checkpoints(self, *, tenant_id: int) -> list[CheckpointRecord]:
        return [_record(checkpoint) for checkpoint in Checkpoint.objects.filter(job__tenant_id=tenant_id)
                .exclude(artifact_uri="").select_related("job").order_by("-job_id", "-step")]


def _record(checkpoint: Checkpoint) -> CheckpointRecord:
    return CheckpointRecord(job_id=checkpoint.job_id, adapter=checkpoint.job.adapter_name, step=checkpoint.step,
                            artifact_uri=checkpoint.artifact_uri, manifest_sha256=checkpoint.manifest_sha256)
