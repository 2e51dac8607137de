"""Dashboard pages of the training pipeline: datasets (upload, validation report, preview) and jobs.

Views translate forms to training.datasets and training.jobs calls and back, as the REST API does;
every rule (limits, validation, job states) lives in those services.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, BinaryIO, cast

from django.conf import settings
from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.csrf import csrf_exempt, csrf_protect
from django.views.decorators.http import require_POST

from serving.wire.errors import InvalidInput, ServiceError
from tenants.dashboard import DashboardRequest, Role, dashboard_view, htmx_redirect, is_htmx
from training import datasets, jobs, selectors
from training.api import DatasetUploadHandler
from training.hyperparameters import ALL_LINEAR, SUPPORTED_TARGET_MODULES, Hyperparameters
from training.models import Dataset, TrainingJob

# One line of help per hyperparameter, shown under its field.
HYPERPARAMETER_HELP = {
    "n_epochs": "Passes over the training examples.",
    "batch_size": "Examples per optimizer step.",
    "learning_rate": "Peak learning rate (AdamW), after warm-up.",
    "max_seq_length": "Longer examples are truncated to this many tokens.",
    "r": "LoRA rank: the adapter's capacity (and size).",
    "lora_alpha": "LoRA scaling; the update is multiplied by alpha / r.",
    "lora_dropout": "Dropout on the LoRA input during training.",
    "warmup_ratio": "Share of the steps spent warming the learning rate up.",
}
_INTEGER_FIELDS = {"n_epochs", "batch_size", "max_seq_length", "r"}


# --- datasets ---------------------------------------------------------------------------------


@dashboard_view(Role.VIEWER)
def dataset_list_view(request: DashboardRequest) -> HttpResponse:
    listed = selectors.dataset_list(tenant=request.dashboard.tenant)
    return render(request, "dashboard/datasets/list.html", {"datasets": listed, "nav": "datasets"})


@csrf_exempt
def dataset_upload_view(request: HttpRequest) -> HttpResponse:
    """The upload streams to disk through the API's handler, which stops at the tier's size limit.

    Upload handlers must be set before anything reads the body, and the CSRF check reads it, so the
    check runs inside (Django's documented csrf_exempt + csrf_protect pattern).
    """
    request.upload_handlers = [DatasetUploadHandler(request)]
    return _dataset_upload(request)


@require_POST
@dashboard_view(Role.MEMBER)
@csrf_protect
def _dataset_upload(request: DashboardRequest) -> HttpResponse:
    # The handler reads the tenant (for its limit) from request.auth, as on the API.
    request.auth = request.dashboard.auth  # type: ignore[attr-defined]  # the attribute DRF's Request sets
    try:
        upload = request.FILES.get("file")
        if upload is None:
            raise InvalidInput("Choose a JSONL file to upload.", code="missing_file", param="file")
        # An UploadedFile is a binary file object (the stubs type it as a File of any string type).
        dataset = datasets.dataset_create(tenant=request.dashboard.tenant, source=cast(BinaryIO, upload),
                                          filename=upload.name or "", size=upload.size)
    except ServiceError as error:
        messages.error(request, error.message)
        return htmx_redirect(request, reverse("dashboard:datasets"))
    messages.success(request, f"Uploaded {dataset.filename}; validating it now.")
    return htmx_redirect(request, reverse("dashboard:dataset", args=[dataset.pk]))


@dashboard_view(Role.VIEWER)
def dataset_detail_view(request: DashboardRequest, dataset_id: int) -> HttpResponse:
    dataset = selectors.dataset_get(tenant=request.dashboard.tenant, dataset_id=dataset_id)
    template = "dashboard/datasets/_report.html" if is_htmx(request) else "dashboard/datasets/detail.html"
    return render(request, template, _dataset_context(dataset) | {"nav": "datasets"})


def _dataset_context(dataset: Dataset) -> dict[str, Any]:
    report = dataset.report or {}
    stats = report.get("stats") or {}
    histogram = stats.get("token_histogram") or []
    peak = max((bucket["count"] for bucket in histogram), default=0)
    return {
        "dataset": dataset, "report": report, "stats": stats,
        "histogram": [bucket | {"percent": round(100 * bucket["count"] / peak) if peak else 0}
                      for bucket in histogram],
        "preview": selectors.dataset_preview(dataset=dataset),
        "pending": dataset.status in (Dataset.Status.UPLOADED, Dataset.Status.VALIDATING),
    }


@require_POST
@dashboard_view(Role.MEMBER)
def dataset_delete_view(request: DashboardRequest, dataset_id: int) -> HttpResponse:
    dataset = selectors.dataset_get(tenant=request.dashboard.tenant, dataset_id=dataset_id)
    try:
        datasets.dataset_delete(dataset=dataset)
    except ServiceError as error:
        messages.error(request, error.message)
        return redirect("dashboard:dataset", dataset_id)
    messages.success(request, f"Deleted {dataset.filename}.")
    return redirect("dashboard:datasets")


# --- training jobs ----------------------------------------------------------------------------


@dashboard_view(Role.VIEWER)
def job_list_view(request: DashboardRequest) -> HttpResponse:
    listed = selectors.job_list(tenant=request.dashboard.tenant)
    return render(request, "dashboard/training/list.html", {"jobs": listed, "nav": "training"})


def _job_form_context(request: DashboardRequest, values: dict[str, Any], error: ServiceError | None) -> dict[str, Any]:
    defaults = Hyperparameters()
    max_rank = settings.MAX_LORA_RANK
    hyperparameters = [
        {"name": item.name, "help": HYPERPARAMETER_HELP[item.name],
         "default": min(defaults.r, max_rank) if item.name == "r" else getattr(defaults, item.name),
         "value": values.get(item.name, ""), "integer": item.name in _INTEGER_FIELDS}
        for item in fields(Hyperparameters) if item.name in HYPERPARAMETER_HELP
    ]
    ready = selectors.dataset_list(tenant=request.dashboard.tenant).filter(status=Dataset.Status.READY)
    return {
        "datasets": ready, "hyperparameters": hyperparameters, "values": values, "error": error,
        "target_modules": SUPPORTED_TARGET_MODULES, "chosen_targets": values.get("targets", []),
        "base_model": settings.BASE_MODEL_NAME, "default_epochs": defaults.n_epochs, "nav": "training",
    }


@dashboard_view(Role.MEMBER)
def job_new_view(request: DashboardRequest) -> HttpResponse:
    values = {"training_file": request.GET.get("dataset", "")}
    return render(request, "dashboard/training/new.html", _job_form_context(request, values, None))


def _form_number(name: str, raw: str, integer: bool) -> int | float | None:
    raw = raw.strip()
    if not raw:
        return None
    try:
        return int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise InvalidInput(f"'{name}' must be {kind}, got '{raw}'.", param=name) from None


def _form_id(name: str, raw: str) -> int | None:
    number = _form_number(name, raw, True)
    return None if number is None else int(number)


@require_POST
@dashboard_view(Role.MEMBER)
def job_create_view(request: DashboardRequest) -> HttpResponse:
    form = request.POST
    values: dict[str, Any] = {key: form.get(key, "") for key in
                              ("training_file", "validation_file", "adapter", "version", "validation_fraction",
                               "seed", *HYPERPARAMETER_HELP)}
    values["targets"] = form.getlist("target_modules")
    try:
        hyperparameters: dict[str, Any] = {name: _form_number(name, values[name], name in _INTEGER_FIELDS)
                                           for name in HYPERPARAMETER_HELP}
        targets = values["targets"]
        hyperparameters["target_modules"] = ALL_LINEAR if not targets or ALL_LINEAR in targets else targets
        job = jobs.training_job_create(
            tenant=request.dashboard.tenant, training_file=_form_id("training_file", values["training_file"]),
            validation_file=_form_id("validation_file", values["validation_file"]),
            validation_fraction=_form_number("validation_fraction", values["validation_fraction"], False),
            adapter=values["adapter"].strip(), version=values["version"].strip() or None,
            hyperparameters={name: value for name, value in hyperparameters.items() if value is not None},
            seed=_form_id("seed", values["seed"]),
        )
    except ServiceError as error:
        return render(request, "dashboard/training/new.html", _job_form_context(request, values, error), status=400)
    messages.success(request, f"Training job {job.pk} is queued.")
    return redirect("dashboard:job", job.pk)


def _job_context(job: TrainingJob) -> dict[str, Any]:
    return {"job": job, "metrics": selectors.job_metrics(job=job), "events": selectors.job_events(job=job)[:50],
            "checkpoints": selectors.job_checkpoints(job=job), "active": not job.is_final,
            "percent": round(100 * job.step / job.total_steps) if job.total_steps else 0}


@dashboard_view(Role.VIEWER)
def job_detail_view(request: DashboardRequest, job_id: int) -> HttpResponse:
    job = selectors.job_get(tenant=request.dashboard.tenant, job_id=job_id)
    template = "dashboard/training/_progress.html" if is_htmx(request) else "dashboard/training/detail.html"
    return render(request, template, _job_context(job) | {"nav": "training"})


@require_POST
@dashboard_view(Role.MEMBER)
def job_cancel_view(request: DashboardRequest, job_id: int) -> HttpResponse:
    job = selectors.job_get(tenant=request.dashboard.tenant, job_id=job_id)
    try:
        jobs.training_job_cancel(job=job)
    except ServiceError as error:
        messages.error(request, error.message)
    else:
        messages.success(request, f"Cancellation of job {job.pk} requested.")
    return redirect("dashboard:job", job.pk)
