"""Training jobs' models as the registry and the gateway see them, without importing training.

A fine-tuning job's models are called by name (serving.contracts.checkpoint_names): the version the
job produced and each checkpoint it keeps. Serving resolves those names (the gateway's catalog,
DELETE /v1/models) but never imports training, which sits above it: training registers its answer
here once (training.apps, as it registers the names its jobs hold in adapter_names), and the rule of
what a job's name stands for stays written once, on the training side (training.job_models).

With nothing registered (a project without the training app) a job's name stands for nothing: the
gateway answers it as a model that does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from serving.registry.models import AdapterVersion


@dataclass(frozen=True)
class JobRecord:
    """A job of the tenant, as far as its names need it."""

    job_id: int
    adapter: str
    base_model: str
    base_model_revision: str
    version: AdapterVersion | None  # the version it registered, if any


@dataclass(frozen=True)
class CheckpointRecord:
    """A checkpoint a job keeps with its adapter artifact (one saved before artifacts is not here)."""

    job_id: int
    adapter: str
    step: int
    artifact_uri: str
    manifest_sha256: str


class JobModels(Protocol):
    def job(self, *, tenant_id: int, job_id: int, adapter: str) -> JobRecord | None:
        """The tenant's job `job_id` training `adapter`, or None."""
        ...

    def checkpoint(self, *, job_id: int, step: int) -> CheckpointRecord | None:
        """The job's kept checkpoint of `step` with its artifact, or None."""
        ...

    def checkpoints(self, *, tenant_id: int) -> list[CheckpointRecord]:
        """Every kept checkpoint with an artifact of the tenant's jobs, newest job first, then newest step."""
        ...


class _NoJobs:
    def job(self, *, tenant_id: int, job_id: int, adapter: str) -> JobRecord | None:
        return None

    def checkpoint(self, *, job_id: int, step: int) -> CheckpointRecord | None:
        return None

    def checkpoints(self, *, tenant_id: int) -> list[CheckpointRecord]:
        return []


_provider: list[JobModels] = [_NoJobs()]


def job_models_register(provider: JobModels) -> None:
    """Registers training's answer (training.apps.TrainingConfig.ready); the last one registered holds."""
    _provider[0] = provider


def job_models() -> JobModels:
    """What answers for the jobs' models: training's once registered, else nothing is a job."""
    return _provider[0]
