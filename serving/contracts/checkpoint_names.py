"""The names a tenant calls a fine-tuning job's models by, built and parsed here only (docs/registry.md, "Names").

- OpenAI's: `ft:<base>:<tenant>:<adapter>:ftjob-<job>:ckpt-step-<N>` names a kept checkpoint of a
  job (`fine_tuned_model_checkpoint` of /v1/fine_tuning/jobs/{id}/checkpoints), and without the last
  part, `ft:<base>:<tenant>:<adapter>:ftjob-<job>`, the version the job produced.
- Ours, pinned: `<adapter>@ftjob-<job>:ckpt-step-<N>`, the registry's `<adapter>@<version>` form
  with the checkpoint's label in the version's place. The label is also the artifact manifest's
  `version` and, behind `<tenant>/<adapter>@`, the name serving workers load it under.

Every part holds no ':' of its own (tenant slugs, adapter names, `ftjob-<n>`), so an OpenAI name is
read from the right and a base model id may hold anything. No Django here: the gateway's catalog
parses with it before any lookup.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FT_PREFIX = "ft:"
_JOB = re.compile(r"ftjob-([0-9]{1,18})")
_STEP = re.compile(r"ckpt-step-([0-9]{1,18})")
_LABEL = re.compile(r"ftjob-([0-9]{1,18}):ckpt-step-([0-9]{1,18})")


@dataclass(frozen=True)
class JobModelName:
    """What a job-model name names: the job's version (`step` None) or its checkpoint at `step`.
    `base` and `tenant` are None in the pinned form, which names neither."""

    adapter: str
    job_id: int
    step: int | None
    base: str | None = None
    tenant: str | None = None

    @property
    def pinned(self) -> str | None:
        """The pinned form of a checkpoint's name (None for a job's version, which has its own `@<version>`)."""
        return None if self.step is None else f"{self.adapter}@{checkpoint_label(self.job_id, self.step)}"


def checkpoint_label(job_id: int, step: int) -> str:
    """`ftjob-<job>:ckpt-step-<N>`: a checkpoint's version label (manifest, pinned name, workers)."""
    return f"ftjob-{job_id}:ckpt-step-{step}"


def checkpoint_model_name(*, base: str, tenant: str, adapter: str, job_id: int, step: int) -> str:
    """OpenAI's `fine_tuned_model_checkpoint` of a checkpoint."""
    return f"{FT_PREFIX}{base}:{tenant}:{adapter}:{checkpoint_label(job_id, step)}"


def checkpoint_pinned_name(*, adapter: str, job_id: int, step: int) -> str:
    """Our pinned name of a checkpoint, `<adapter>@ftjob-<job>:ckpt-step-<N>`."""
    return f"{adapter}@{checkpoint_label(job_id, step)}"


def job_model_parse(model: str) -> JobModelName | None:
    """The job model `model` names in either form, or None when it is in neither (then it is an
    adapter, a pinned version or the base model; the catalog goes on as before)."""
    if model.startswith(FT_PREFIX):
        return _parse_openai(model.removeprefix(FT_PREFIX))
    adapter, at, label = model.partition("@")
    match = _LABEL.fullmatch(label) if at else None
    if match is None or not adapter:
        return None
    return JobModelName(adapter=adapter, job_id=int(match[1]), step=int(match[2]))


def _parse_openai(rest: str) -> JobModelName | None:
    parts = rest.rsplit(":", 4)
    if len(parts) == 5 and (step := _STEP.fullmatch(parts[4])) and (job := _JOB.fullmatch(parts[3])):
        base, tenant, adapter = parts[:3]
        return _named(base, tenant, adapter, int(job[1]), int(step[1]))
    parts = rest.rsplit(":", 3)
    if len(parts) == 4 and (job := _JOB.fullmatch(parts[3])):
        base, tenant, adapter = parts[:3]
        return _named(base, tenant, adapter, int(job[1]), None)
    return None


def _named(base: str, tenant: str, adapter: str, job_id: int, step: int | None) -> JobModelName | None:
    if not (base and tenant and adapter):
        return None
    return JobModelName(adapter=adapter, job_id=job_id, step=step, base=base, tenant=tenant)
