"""The training pages: the new-job form, the job list, a job's progress, cancel, pause and resume.

Views translate the form to a training.jobs call and back, as the REST API does; every rule
(limits, hyperparameter bounds, job states) lives in that service.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.http import HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from dashboard.htmx import is_htmx
from dashboard.tenancy import DashboardRequest, Role, dashboard_view
from dashboard.views.checkpoints import checkpoint_models
from serving.contracts.errors import InvalidInput, ServiceError
from training import conf, jobs, selectors
from training.hyperparameters import (
    ALL_LINEAR,
    AUTO_NAMES,
    BASE_QUANTIZATIONS,
    DPO,
    METHODS,
    SCHEDULES,
    VOCABULARY_MODULES,
    Hyperparameters,
    fit_to_dataset,
)
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
    "weight_decay": "AdamW's weight decay on the LoRA matrices.",
    "gradient_accumulation_steps": "Micro-batches a step's examples go through the model in (less memory).",
    "beta": "DPO only: how far the adapter may move from the base to fit the preferences.",
}
# An empty field of these is sent as "auto" (the OpenAI API's default for them): picked from the
# dataset's size, so a small dataset gets the epochs and learning rate it needs (training.hyperparameters).
AUTO_HELP = "Empty: auto, picked from the number of training examples."
# Fields of one method only: the form shows them while that method is chosen (app.js).
_METHOD_ONLY = {"beta": DPO}
_INTEGER_FIELDS = {"n_epochs", "batch_size", "max_seq_length", "r", "gradient_accumulation_steps"}
# The form's choices and switches beside the numbers (training.hyperparameters).
_CHOICE_FIELDS = ("method", "lr_scheduler_type", "base_quantization")
_SWITCHES = ("packing", "gradient_checkpointing", "use_dora")


@dashboard_view(Role.VIEWER)
def job_list_view(request: DashboardRequest) -> HttpResponse:
    listed = selectors.job_list(tenant=request.dashboard.tenant)
    return render(request, "dashboard/training/list.html", {"jobs": listed, "nav": "training"})


def _job_form_context(request: DashboardRequest, values: dict[str, Any], error: ServiceError | None) -> dict[str, Any]:
    defaults = Hyperparameters()
    max_rank = settings.MAX_LORA_RANK
    hyperparameters = [
        {"name": item.name, "help": HYPERPARAMETER_HELP[item.name], "auto": item.name in AUTO_NAMES,
         "default": min(defaults.r, max_rank) if item.name == "r" else getattr(defaults, item.name),
         "value": values.get(item.name, ""), "integer": item.name in _INTEGER_FIELDS,
         "method": _METHOD_ONLY.get(item.name)}
        for item in fields(Hyperparameters) if item.name in HYPERPARAMETER_HELP
    ]
    ready = selectors.dataset_list(tenant=request.dashboard.tenant).filter(status=Dataset.Status.READY)
    limits = conf.limits()
    # The epochs "auto" picks for each dataset, for the form's token estimate (app.js).
    auto_epochs = Hyperparameters(auto=["n_epochs"])
    training_choices = [{"dataset": dataset,
                         "auto_epochs": fit_to_dataset(auto_epochs, dataset.num_examples or 0, limits).n_epochs}
                        for dataset in ready]
    return {
        "datasets": ready, "training_choices": training_choices, "hyperparameters": hyperparameters,
        "values": values, "error": error, "auto_help": AUTO_HELP,
        "target_modules": conf.base_target_modules(), "chosen_targets": values.get("targets", []),
        # Offered only where the engine would serve them (not on a base that ties the two).
        "vocabulary_modules": VOCABULARY_MODULES if conf.base_vocabulary_problem() is None else (),
        "quantizations": BASE_QUANTIZATIONS,
        "base_model": settings.BASE_MODEL_NAME, "nav": "training",
        "methods": METHODS, "schedules": SCHEDULES,
        "tokens_per_second": selectors.recent_tokens_per_second(tenant=request.dashboard.tenant),
        "switches": [{"name": name, "checked": bool(values.get(name))} for name in _SWITCHES],
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


def _targets(checked: list[str]) -> str | list[str]:
    """The form's ticked targets as the job's target_modules: "all-linear" ticked (or nothing) is
    every projection; with a vocabulary module beside it, the base's projections named one by one
    (a list cannot hold "all-linear")."""
    vocabulary = [name for name in VOCABULARY_MODULES if name in checked]
    if ALL_LINEAR in checked or not checked:
        return [*conf.base_target_modules(), *vocabulary] if vocabulary else ALL_LINEAR
    return checked


@require_POST
@dashboard_view(Role.MEMBER)
def job_create_view(request: DashboardRequest) -> HttpResponse:
    form = request.POST
    values: dict[str, Any] = {key: form.get(key, "") for key in
                              ("training_file", "validation_file", "adapter", "version", "validation_fraction",
                               "seed", *HYPERPARAMETER_HELP, *_CHOICE_FIELDS)}
    values["targets"] = form.getlist("target_modules")
    values.update({name: name in form for name in _SWITCHES})
    try:
        hyperparameters: dict[str, Any] = {name: _form_number(name, values[name], name in _INTEGER_FIELDS)
                                           for name in HYPERPARAMETER_HELP}
        hyperparameters.update({name: "auto" for name in AUTO_NAMES if hyperparameters[name] is None})
        hyperparameters["target_modules"] = _targets(values["targets"])
        hyperparameters.update({name: values[name] or None for name in _CHOICE_FIELDS})
        hyperparameters.update({name: values[name] for name in _SWITCHES})
        # A field of another method, typed before the method was changed, was hidden: not sent on.
        chosen = hyperparameters.get("method") or Hyperparameters.method
        hyperparameters.update({name: None for name, method in _METHOD_ONLY.items() if method != chosen})
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
    # Shown while the job is queued (app.js drops it once the page shows another state: the job may
    # even have finished before its page first loads).
    messages.success(request, f"Training job {job.pk} is queued.", extra_tags=f"job-{job.pk}:queued")
    return redirect("dashboard:job", job.pk)


def _time_left(job: TrainingJob) -> str | None:
    """"about 3 min left" from the job's estimated finish (training.pace), while it runs."""
    if job.is_final or job.estimated_finish is None:
        return None
    seconds = max(0.0, (job.estimated_finish - timezone.now()).total_seconds())
    if seconds < 60:
        return "under a minute left"
    if seconds < 90 * 60:
        return f"about {round(seconds / 60)} min left"
    return f"about {seconds / 3600:.1f} h left"


def _job_context(job: TrainingJob) -> dict[str, Any]:
    checkpoints = list(selectors.job_checkpoints(job=job).select_related("job"))
    metrics = selectors.job_metrics(job=job)
    return {"job": job, "metrics": metrics, "events": selectors.job_events(job=job)[:50],
            # The chart has a validation series only where the job has validation examples.
            "validated": bool(job.validation_dataset_id or job.validation_fraction), "time_left": _time_left(job),
            "tokens_per_second": next((point["tokens_per_second"] for point in reversed(metrics)
                                       if point.get("tokens_per_second") is not None), None),
            "checkpoints": checkpoints, "checkpoint_models": checkpoint_models(checkpoints), "active": not job.is_final,
            # A paused job changes only when someone resumes it (the page then reloads): no polling.
            "polling": not job.is_final and job.status != TrainingJob.Status.PAUSED,
            "checkpoint_every": conf.setting_int("TRAINING_CHECKPOINT_EVERY_STEPS"),
            "percent": round(100 * job.step / job.total_steps) if job.total_steps else 0}


@dashboard_view(Role.VIEWER)
def job_detail_view(request: DashboardRequest, job_id: int) -> HttpResponse:
    """The job's page; to htmx's poll (every 2 s while it runs) its progress and settings."""
    job = selectors.job_get(tenant=request.dashboard.tenant, job_id=job_id)
    polled = is_htmx(request)
    template = "dashboard/training/_progress.html" if polled else "dashboard/training/detail.html"
    return render(request, template, _job_context(job) | {"nav": "training", "polled": polled})


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


@require_POST
@dashboard_view(Role.MEMBER)
def job_pause_view(request: DashboardRequest, job_id: int) -> HttpResponse:
    job = selectors.job_get(tenant=request.dashboard.tenant, job_id=job_id)
    try:
        paused = jobs.training_job_pause(job=job)
    except ServiceError as error:
        messages.error(request, error.message)
    else:
        done = paused.status == TrainingJob.Status.PAUSED
        messages.success(request, f"Job {job.pk} is paused." if done else
                         f"Pause of job {job.pk} requested: it saves a checkpoint and pauses before its next step.")
    return redirect("dashboard:job", job.pk)


@require_POST
@dashboard_view(Role.MEMBER)
def job_resume_view(request: DashboardRequest, job_id: int) -> HttpResponse:
    job = selectors.job_get(tenant=request.dashboard.tenant, job_id=job_id)
    try:
        jobs.training_job_resume(job=job)
    except ServiceError as error:
        messages.error(request, error.message)
    else:
        messages.success(request, f"Job {job.pk} resumed: it goes on from its newest checkpoint.")
    return redirect("dashboard:job", job.pk)
