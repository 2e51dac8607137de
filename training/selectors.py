"""Queries of the training pipeline that views, admin and services share."""

from __future__ import annotations

import csv
import io
from typing import Any, BinaryIO

from django.db.models import QuerySet

from serving.contracts.errors import NotFound
from serving.registry.storage import get_storage
from tenants.models import Tenant
from training.examples import Example, load_json_line, parse_example
from training.models import Checkpoint, Dataset, TrainingEvent, TrainingJob
from training.preference import PREFERENCE, parse as parse_preference
from training.validation import iter_lines


def adapter_names_held(tenant: Tenant) -> dict[str, str]:
    """The adapter names the tenant's queued and running jobs will publish to, each with its oldest job.

    The registry keeps the ones that are not adapters yet as held: their room under the tier's
    max_adapters is taken from the job's creation on (serving.registry.adapter_names.adapter_room_check).
    """
    held: dict[str, str] = {}
    active = TrainingJob.objects.for_tenant(tenant).filter(status__in=TrainingJob.ACTIVE_STATUSES).order_by("id")
    for name, pk in active.values_list("adapter_name", "pk"):
        held.setdefault(name, f"training job #{pk}")
    return held


def job_events(*, job: TrainingJob) -> QuerySet[TrainingEvent]:
    return TrainingEvent.objects.filter(job=job).order_by("-id")


def job_checkpoints(*, job: TrainingJob) -> QuerySet[Checkpoint]:
    return Checkpoint.objects.filter(job=job).order_by("-id")


# The columns of OpenAI's results file of a fine-tuning job (our train_mean_token_accuracy is its
# train_accuracy; validation accuracy is not measured here, so that column stays empty).
RESULT_COLUMNS = ("step", "train_loss", "train_accuracy", "valid_loss", "valid_mean_token_accuracy")
_RESULT_KEYS = ("step", "train_loss", "train_mean_token_accuracy", "valid_loss", "valid_mean_token_accuracy")


def job_results_csv(*, job: TrainingJob) -> bytes:
    """The job's metrics as OpenAI's results CSV, one row per logged step (the last run's, where a
    resumed run logged a step again); a cell is empty where nothing was measured."""
    by_step: dict[int, dict] = {}
    for data in TrainingEvent.objects.filter(job=job, type=TrainingEvent.Type.METRICS).order_by("id") \
            .values_list("data", flat=True):
        by_step[data["step"]] = data
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(RESULT_COLUMNS)
    for step in sorted(by_step):
        writer.writerow(["" if by_step[step].get(key) is None else by_step[step][key] for key in _RESULT_KEYS])
    return out.getvalue().encode()


def dataset_content(*, dataset: Dataset) -> BinaryIO:
    """The stored file, as uploaded (a stream to close); NotFound when storage has lost it."""
    try:
        return get_storage().open(dataset.storage_key)
    except NotFound:
        raise NotFound(f"The file of dataset {dataset.pk} is missing from storage; upload it again.",
                       code="file_missing") from None


def dataset_list(*, tenant: Tenant) -> QuerySet[Dataset]:
    return Dataset.objects.for_tenant(tenant).order_by("-id")


def dataset_get(*, tenant: Tenant, dataset_id: int) -> Dataset:
    """The tenant's dataset; another tenant's is as missing as one that never existed."""
    dataset = Dataset.objects.for_tenant(tenant).filter(pk=dataset_id).first()
    if dataset is None:
        raise NotFound(f"No dataset {dataset_id}.", code="dataset_not_found", param="id")
    return dataset


def job_list(*, tenant: Tenant) -> QuerySet[TrainingJob]:
    return (TrainingJob.objects.for_tenant(tenant).select_related("dataset", "adapter_version")
            .order_by("-id"))


def job_get(*, tenant: Tenant, job_id: int) -> TrainingJob:
    job = job_list(tenant=tenant).filter(pk=job_id).first()
    if job is None:
        raise NotFound(f"No training job {job_id}.", code="job_not_found", param="id")
    return job


def job_metrics(*, job: TrainingJob) -> list[dict[str, Any]]:
    """The job's metrics points (step, train_loss, valid_loss, …) in step order, for its loss chart."""
    rows = TrainingEvent.objects.filter(job=job, type=TrainingEvent.Type.METRICS).order_by("id")
    return [row for row in rows.values_list("data", flat=True) if "step" in row]


def recent_tokens_per_second(*, tenant: Tenant) -> float | None:
    """The training pace (trained tokens a second) last measured on one of the tenant's jobs: what the
    new-job form sizes a job's duration by; None before any was measured."""
    for data in (TrainingEvent.objects.filter(job__tenant=tenant, type=TrainingEvent.Type.METRICS)
                 .order_by("-id").values_list("data", flat=True)[:20]):
        if data.get("tokens_per_second"):
            return float(data["tokens_per_second"])
    return None


def dataset_preview(*, dataset: Dataset, limit: int = 3) -> list[Example]:
    """The first `limit` valid examples of a ready dataset, read from storage (for its page)."""
    if dataset.status != Dataset.Status.READY or not dataset.format:
        return []
    examples: list[Example] = []
    try:
        with dataset_content(dataset=dataset) as raw:
            for line in iter_lines(raw):
                if not line.strip():
                    continue
                value = load_json_line(line)
                if dataset.format == PREFERENCE:
                    # A pair shows as its conversation with the preferred reply.
                    pair, _, _ = parse_preference(value)
                    example = pair.preferred if pair is not None else None
                else:
                    example, _, _ = parse_example(value, dataset.format)
                if example is not None:
                    examples.append(example)
                if len(examples) >= limit:
                    break
    except (NotFound, ValueError):
        return examples
    return examples
