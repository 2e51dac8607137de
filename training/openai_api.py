"""OpenAI's files and fine-tuning API under /v1/, on the dataset and training-job services.

A team that fine-tunes with OpenAI's SDK moves here by changing `base_url` and `api_key`: the
paths, request fields, objects, statuses, cursor lists and errors are OpenAI's. Each object is a
row the management API (/api/v1/) also shows: `file-<n>` is dataset n, `ftjob-<n>` training job
n, `ftevent-<n>` and `ftckpt-<n>` its events and checkpoints. Views only translate names and
shapes; every rule is in training.datasets and training.jobs (and training.hyperparameters), as for /api/v1/.

Decisions where OpenAI's API and this platform differ (docs/training.md says the same):
- `model` is the base model's id; `suffix` is the adapter's name (without one, each job gets an
  adapter `ft-<8 hex>` of its own), so `fine_tuned_model` is `<adapter>@<version>`, the `model`
  the gateway serves.
- `hyperparameters` take our LoRA knobs (`r`, `lora_alpha`, `target_modules`, …) beside
  OpenAI's; unknown names are refused.
- `method` is OpenAI's (`supervised`, or `dpo` with its `beta`; training.methods reads it); the
  job keeps it among its hyperparameters.
- Every kept checkpoint is a model: `fine_tuned_model_checkpoint` is OpenAI's
  `ft:<base>:<tenant>:<adapter>:ftjob-<n>:ckpt-step-<N>`, which the gateway serves (and
  `<adapter>@ftjob-<n>:ckpt-step-<N>`, serving.contracts.checkpoint_names).
- A succeeded job's `result_files` names one file, `file-results-<n>`: its metrics as OpenAI's
  results CSV, made from its events when read (not listed among the files, not deletable alone).
"""

from __future__ import annotations

import secrets
from datetime import datetime
from collections.abc import Iterable
from typing import Any

from django.db.models import QuerySet
from django.http import FileResponse, HttpRequest, HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.metadata import SimpleMetadata
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.parsers import BaseParser, FormParser, MultiPartParser
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from api.parsers import JSONParser
from api.schema import error_response
from serving.contracts.errors import InvalidInput, NotFound, ServiceError
from api.pagination import PageRequest, list_body, page_request, paging_parameters, take
from tenants.scoping import TenantScopedAPIView, TenantScopedQuerySet
from training import base, datasets, jobs, selectors
from training.api import DatasetUploadHandler
from serving.contracts.checkpoint_names import checkpoint_model_name
from training.hyperparameters import from_openai, method_object, to_openai
from training.methods import requested_hyperparameters
from training.models import Checkpoint, Dataset, TrainingEvent, TrainingJob

FILE_PREFIX = "file-"
# A succeeded job's results file (its metrics as CSV), made from its events when asked for.
RESULTS_PREFIX = "file-results-"
RESULTS_FILENAME = "step_metrics.csv"
JOB_PREFIX = "ftjob-"
EVENT_PREFIX = "ftevent-"
CHECKPOINT_PREFIX = "ftckpt-"
PURPOSE = "fine-tune"
# The request fields of POST /v1/fine_tuning/jobs (OpenAI's); anything else is refused by name.
JOB_FIELDS = frozenset({"model", "training_file", "validation_file", "hyperparameters", "method", "suffix", "seed",
                        "metadata", "integrations"})
# Services name the adapter `adapter`; here it is OpenAI's `suffix`.
_PARAM_NAMES: dict[str | None, str | None] = {"adapter": "suffix"}

_FILE_STATUS: dict[str, str] = {Dataset.Status.UPLOADED: "uploaded", Dataset.Status.VALIDATING: "uploaded",
                                Dataset.Status.READY: "processed", Dataset.Status.INVALID: "error"}
_EVENT_LEVEL: dict[str, str] = {TrainingEvent.Level.WARNING: "warn"}
_ERROR_PARAM = {"invalid_training_file": "training_file", "invalid_validation_file": "validation_file"}
STATUS_DETAIL_ERRORS = 5


def _unix(moment: datetime | None) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


def _prefixed(prefix: str, pk: int | None) -> str | None:
    return f"{prefix}{pk}" if pk is not None else None


def _pk(prefix: str, value: Any, what: str, code: str, param: str | None = None) -> int:
    """The row id inside an OpenAI-style id; NotFound (as for a missing row) when it is not one."""
    text = value if isinstance(value, str) else ""
    number = text.removeprefix(prefix)
    if not text.startswith(prefix) or not number.isdigit() or len(number) > 18:
        raise NotFound(f"No such {what}: {value!r}.", code=code, param=param)
    return int(number)


# --- the objects --------------------------------------------------------------------------------


def file_object(dataset: Dataset) -> dict[str, Any]:
    """OpenAI's File object for a dataset; an invalid one's first errors, with lines, in status_details."""
    details = None
    if dataset.status == Dataset.Status.INVALID:
        errors = dataset.report.get("errors", [])
        count = sum(dataset.report.get("error_counts", {}).values())
        lines = [f"line {item['line']}: {item['code']}: {item['message']}" if item.get("line")
                 else f"{item['code']}: {item['message']}" for item in errors[:STATUS_DETAIL_ERRORS]]
        more = f" (and {count - len(lines)} more)" if count > len(lines) else ""
        details = f"{count} error(s): " + "; ".join(lines) + more
    return {"id": f"{FILE_PREFIX}{dataset.pk}", "object": "file", "bytes": dataset.size_bytes,
            "created_at": _unix(dataset.created_at), "filename": dataset.filename, "purpose": PURPOSE,
            "status": _FILE_STATUS[dataset.status], "status_details": details, "expires_at": None}


def results_file_object(job: TrainingJob) -> dict[str, Any]:
    """OpenAI's File object for a succeeded job's results file."""
    return {"id": f"{RESULTS_PREFIX}{job.pk}", "object": "file", "bytes": len(selectors.job_results_csv(job=job)),
            "created_at": _unix(job.finished_at), "filename": RESULTS_FILENAME, "purpose": "fine-tune-results",
            "status": "processed", "status_details": None, "expires_at": None}


def _job_status(job: TrainingJob) -> str:
    if job.status == TrainingJob.Status.QUEUED and any(
            item is not None and item.status in base.PENDING_DATASET_STATUSES
            for item in (job.dataset, job.validation_dataset)):
        return "validating_files"
    return job.status


def job_object(job: TrainingJob) -> dict[str, Any]:
    """OpenAI's fine_tuning.job object for a training job."""
    succeeded = job.status == TrainingJob.Status.SUCCEEDED
    failed = job.status == TrainingJob.Status.FAILED
    hyperparameters = to_openai(job.hyperparameters)
    return {
        "id": f"{JOB_PREFIX}{job.pk}", "object": "fine_tuning.job", "created_at": _unix(job.created_at),
        "finished_at": _unix(job.finished_at), "model": job.base_model,
        "fine_tuned_model": f"{job.adapter_name}@{job.version}" if succeeded else None,
        "organization_id": job.tenant.slug, "status": _job_status(job),
        "training_file": _prefixed(FILE_PREFIX, job.dataset_id),
        "validation_file": _prefixed(FILE_PREFIX, job.validation_dataset_id),
        "hyperparameters": hyperparameters,
        "method": method_object(job.hyperparameters),
        "result_files": [f"{RESULTS_PREFIX}{job.pk}"] if succeeded else [],
        "trained_tokens": job.trained_tokens if job.is_final else None,
        "error": ({"code": job.error_code, "message": job.error_message, "param": _ERROR_PARAM.get(job.error_code)}
                  if failed else None),
        "seed": job.seed,
        "estimated_finish": _unix(job.estimated_finish) if job.status == TrainingJob.Status.RUNNING else None,
        "integrations": [], "metadata": job.metadata or None, "user_provided_suffix": job.adapter_name,
    }


def event_object(event: TrainingEvent) -> dict[str, Any]:
    return {"id": f"{EVENT_PREFIX}{event.pk}", "object": "fine_tuning.job.event", "created_at": _unix(event.created_at),
            "level": _EVENT_LEVEL.get(event.level, event.level), "message": event.message, "type": event.type,
            "data": event.data or None}


def checkpoint_object(checkpoint: Checkpoint) -> dict[str, Any]:
    job = checkpoint.job
    return {"id": f"{CHECKPOINT_PREFIX}{checkpoint.pk}", "object": "fine_tuning.job.checkpoint",
            "created_at": _unix(checkpoint.created_at),
            "fine_tuned_model_checkpoint": checkpoint_model_name(
                base=job.base_model, tenant=job.tenant.slug, adapter=job.adapter_name, job_id=job.pk,
                step=checkpoint.step),
            "fine_tuning_job_id": f"{JOB_PREFIX}{checkpoint.job_id}", "step_number": checkpoint.step,
            "metrics": {"step": checkpoint.step, **(checkpoint.metrics or {})}}


def _newest_first(queryset: QuerySet, page: PageRequest, prefix: str, *, ascending: bool = False) -> tuple[list, bool]:
    """One page of rows by id (newest first unless `ascending`), after the cursor's row."""
    after = page.int_after(prefix)
    if after is not None:
        queryset = queryset.filter(pk__gt=after) if ascending else queryset.filter(pk__lt=after)
    return take(queryset.order_by("id" if ascending else "-id"), page.limit)


# --- views --------------------------------------------------------------------------------------


class _IgnoreAccept(BaseContentNegotiation):
    """OpenAI's API answers JSON (or a file's bytes) whatever `Accept` says; the SDK asks for a file's
    content with `Accept: application/binary`, which no renderer names."""

    def select_parser(self, request: Request, parsers: Iterable[BaseParser]) -> BaseParser | None:
        return next((parser for parser in parsers if parser.media_type == request.content_type.split(";")[0]),
                    None)

    def select_renderer(self, request: Request, renderers: Iterable[BaseRenderer],
                        format_suffix: str | None = None) -> tuple[BaseRenderer, str]:
        renderer = next(iter(renderers))
        return renderer, renderer.media_type


class _NoFieldsMetadata(SimpleMetadata):
    """OPTIONS names the view and what it parses and renders, without describing request fields: these
    views take OpenAI's shapes with no DRF serializer, and SimpleMetadata's field description asks the
    view for one (AssertionError, a 500, before this). The schema (/api/schema/) describes the bodies."""

    def determine_actions(self, request: Request, view: APIView) -> dict[str, Any]:
        return {}


class OpenAIView(TenantScopedAPIView):
    """The caller's rows only: another tenant's file or job is as missing as one that never was."""

    content_negotiation_class = _IgnoreAccept
    metadata_class = _NoFieldsMetadata

    def handle_exception(self, exc: Exception) -> Response:
        response = super().handle_exception(exc)
        if response.status_code == status.HTTP_409_CONFLICT:
            # OpenAI's SDK retries a 409 by default, unless told not to: here a conflict is a decision
            # (a file in use, a job already ended) that a retry would only meet again.
            response["x-should-retry"] = "false"
        return response

    def file(self, file_id: Any, param: str | None = None) -> Dataset:
        pk = _pk(FILE_PREFIX, file_id, "File object", "file_not_found", param)
        dataset = Dataset.objects.for_tenant(self.tenant).filter(pk=pk).first()
        if dataset is None:
            raise NotFound(f"No such File object: {file_id!r}.", code="file_not_found", param=param)
        return dataset

    def results_of(self, file_id: str) -> TrainingJob | None:
        """The succeeded job whose results file `file_id` names; None when it names no results file."""
        if not file_id.startswith(RESULTS_PREFIX):
            return None
        pk = _pk(RESULTS_PREFIX, file_id, "File object", "file_not_found")
        job = _jobs().for_tenant(self.tenant).filter(pk=pk, status=TrainingJob.Status.SUCCEEDED).first()
        if job is None:
            raise NotFound(f"No such File object: {file_id!r}.", code="file_not_found")
        return job

    def job(self, job_id: str) -> TrainingJob:
        pk = _pk(JOB_PREFIX, job_id, "fine-tuning job", "fine_tuning_job_not_found")
        job = _jobs().for_tenant(self.tenant).filter(pk=pk).first()
        if job is None:
            raise NotFound(f"No such fine-tuning job: {job_id!r}.", code="fine_tuning_job_not_found")
        return job


def _jobs() -> TenantScopedQuerySet:
    return TrainingJob.objects.select_related("tenant", "dataset", "validation_dataset")


class FilesView(OpenAIView):
    queryset = Dataset.objects.all()
    parser_classes = [MultiPartParser, FormParser]

    def initialize_request(self, request: HttpRequest, *args: Any, **kwargs: Any) -> Request:
        if request.method == "POST":
            request.upload_handlers = [DatasetUploadHandler(request)]
        return super().initialize_request(request, *args, **kwargs)

    @extend_schema(parameters=[*paging_parameters("the file id")], responses=OpenApiTypes.OBJECT,
                   operation_id="openai_files_list",
                   summary="OpenAI: list files (purpose fine-tune), newest first unless order=asc")
    def get(self, request: Request) -> Response:
        page = page_request(request)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidInput(f"'order' must be 'asc' or 'desc', got {order!r}.", param="order")
        files = self.get_queryset()
        if request.query_params.get("purpose") not in (None, "", PURPOSE):
            files = files.none()
        rows, has_more = _newest_first(files, page, FILE_PREFIX, ascending=order == "asc")
        return Response(list_body([file_object(row) for row in rows], has_more=has_more))

    @extend_schema(request={"multipart/form-data": OpenApiTypes.OBJECT}, responses={200: OpenApiTypes.OBJECT},
                   operation_id="openai_files_create",
                   summary="OpenAI: upload a JSONL file (multipart `file`, `purpose=fine-tune`)")
    def post(self, request: Request) -> Response:
        form = request.data if isinstance(request.data, dict) else {}  # a multipart form: a QueryDict
        purpose = form.get("purpose")
        if not purpose:
            raise InvalidInput("Missing required parameter: 'purpose' (use 'fine-tune').", code="missing_purpose",
                               param="purpose")
        if purpose != PURPOSE:
            raise InvalidInput(f"Files here are for fine-tuning only: 'purpose' must be '{PURPOSE}', got "
                               f"{purpose!r}.", code="invalid_purpose", param="purpose")
        upload = request.FILES.get("file")
        if upload is None:
            raise InvalidInput("Upload the JSONL file as the multipart form field 'file'.", code="missing_file",
                               param="file")
        dataset = datasets.dataset_create(tenant=self.tenant, source=upload, filename=upload.name, size=upload.size)
        # OpenAI answers 200 with the new file object.
        return Response(file_object(dataset), status=status.HTTP_200_OK)


class FileView(OpenAIView):
    queryset = Dataset.objects.all()

    @extend_schema(responses=OpenApiTypes.OBJECT, operation_id="openai_files_retrieve",
                   summary="OpenAI: a file, with status_details when invalid")
    def get(self, request: Request, file_id: str) -> Response:
        results = self.results_of(file_id)
        return Response(results_file_object(results) if results is not None else file_object(self.file(file_id)))

    @extend_schema(responses=OpenApiTypes.OBJECT,
                   operation_id="openai_files_delete",
                   summary="OpenAI: delete a file (409 while a queued, running or paused job uses it)")
    def delete(self, request: Request, file_id: str) -> Response:
        if self.results_of(file_id) is not None:
            raise InvalidInput("A job's results file is made from its metrics and goes with the job; it cannot be "
                               "deleted alone.", code="results_file_not_deletable", param="file_id")
        dataset = self.file(file_id)
        datasets.dataset_delete(dataset=dataset)
        return Response({"id": f"{FILE_PREFIX}{dataset.pk}", "object": "file", "deleted": True})


class FileContentView(OpenAIView):
    queryset = Dataset.objects.all()

    @extend_schema(responses={(200, "application/octet-stream"): OpenApiTypes.BINARY},
                   operation_id="openai_files_content",
                   summary="OpenAI: the file's content, as uploaded")
    def get(self, request: Request, file_id: str) -> HttpResponse | FileResponse:
        results = self.results_of(file_id)
        if results is not None:
            return HttpResponse(selectors.job_results_csv(job=results), content_type="text/csv")
        dataset = self.file(file_id)
        return FileResponse(selectors.dataset_content(dataset=dataset), filename=dataset.filename,
                            content_type="application/octet-stream")


class JobsView(OpenAIView):
    queryset = TrainingJob.objects.all()
    parser_classes = [JSONParser]

    def get_queryset(self) -> QuerySet[TrainingJob]:
        return super().get_queryset().select_related("tenant", "dataset", "validation_dataset")

    @extend_schema(parameters=paging_parameters("the job id"), responses=OpenApiTypes.OBJECT,
                   operation_id="openai_jobs_list",
                   summary="OpenAI: list fine-tuning jobs, newest first")
    def get(self, request: Request) -> Response:
        rows, has_more = _newest_first(self.get_queryset(), page_request(request), JOB_PREFIX)
        return Response(list_body([job_object(row) for row in rows], has_more=has_more))

    @extend_schema(request=OpenApiTypes.OBJECT,
                   responses={200: OpenApiTypes.OBJECT,
                              404: error_response("No such file (training_file or validation_file) in the caller's "
                                                  "tenant.")},
                   operation_id="openai_jobs_create",
                   summary="OpenAI: create a fine-tuning job (model = the base model, suffix = the adapter)")
    def post(self, request: Request) -> Response:
        body = request.data
        if not isinstance(body, dict):
            raise InvalidInput("The request body must be a JSON object.")
        unknown = sorted(set(body) - JOB_FIELDS)
        if unknown:
            raise InvalidInput(f"Unrecognized request argument(s) supplied: {', '.join(unknown)}.",
                               code="unknown_parameter", param=unknown[0])
        for name in ("model", "training_file"):
            if body.get(name) in (None, ""):
                raise InvalidInput(f"Missing required parameter: '{name}'.", code="missing_required_parameter",
                                   param=name)
        if body.get("integrations"):
            raise InvalidInput("Integrations (such as wandb) are not supported here; leave 'integrations' out.",
                               code="unsupported_parameter", param="integrations")
        training = self.file(body["training_file"], "training_file")
        validation = (self.file(body["validation_file"], "validation_file")
                      if body.get("validation_file") is not None else None)
        suffix = body.get("suffix")
        try:
            job = jobs.training_job_create(
                tenant=self.tenant, training_file=training.pk,
                validation_file=validation.pk if validation is not None else None,
                adapter=f"ft-{secrets.token_hex(4)}" if suffix in (None, "") else suffix,
                hyperparameters=from_openai(requested_hyperparameters(body)), seed=body.get("seed"),
                base_model=body["model"], metadata=body.get("metadata"), await_validation=True,
            )
        except ServiceError as error:
            error.param = _PARAM_NAMES.get(error.param, error.param)
            raise
        return Response(job_object(_jobs().get(pk=job.pk)), status=status.HTTP_200_OK)


class JobView(OpenAIView):
    queryset = TrainingJob.objects.all()

    @extend_schema(responses=OpenApiTypes.OBJECT, operation_id="openai_jobs_retrieve",
                   summary="OpenAI: a fine-tuning job")
    def get(self, request: Request, job_id: str) -> Response:
        return Response(job_object(self.job(job_id)))


class JobCancelView(OpenAIView):
    queryset = TrainingJob.objects.all()

    @extend_schema(request=None, responses=OpenApiTypes.OBJECT,
                   operation_id="openai_jobs_cancel",
                   summary="OpenAI: cancel a job (a queued one at once, a running one before its next step)")
    def post(self, request: Request, job_id: str) -> Response:
        job = jobs.training_job_cancel(job=self.job(job_id))
        return Response(job_object(_jobs().get(pk=job.pk)))


class JobPauseView(OpenAIView):
    queryset = TrainingJob.objects.all()

    @extend_schema(request=None, responses=OpenApiTypes.OBJECT, operation_id="openai_jobs_pause",
                   summary="OpenAI: pause a job (a queued one at once, a running one after a checkpoint before its "
                           "next step); a paused job frees its place under the tenant's concurrent-job limit")
    def post(self, request: Request, job_id: str) -> Response:
        job = jobs.training_job_pause(job=self.job(job_id))
        return Response(job_object(_jobs().get(pk=job.pk)))


class JobResumeView(OpenAIView):
    queryset = TrainingJob.objects.all()

    @extend_schema(request=None, responses=OpenApiTypes.OBJECT, operation_id="openai_jobs_resume",
                   summary="OpenAI: resume a paused job from its newest checkpoint (queued until the limit has room)")
    def post(self, request: Request, job_id: str) -> Response:
        job = jobs.training_job_resume(job=self.job(job_id))
        return Response(job_object(_jobs().get(pk=job.pk)))


class JobEventsView(OpenAIView):
    queryset = TrainingJob.objects.all()

    @extend_schema(parameters=paging_parameters("the event id"), responses=OpenApiTypes.OBJECT,
                   operation_id="openai_jobs_events",
                   summary="OpenAI: a job's events (messages and metrics), newest first")
    def get(self, request: Request, job_id: str) -> Response:
        events = selectors.job_events(job=self.job(job_id))
        rows, has_more = _newest_first(events, page_request(request), EVENT_PREFIX)
        return Response(list_body([event_object(row) for row in rows], has_more=has_more))


class JobCheckpointsView(OpenAIView):
    queryset = TrainingJob.objects.all()

    @extend_schema(parameters=paging_parameters("the checkpoint id"), responses=OpenApiTypes.OBJECT,
                   operation_id="openai_jobs_checkpoints",
                   summary="OpenAI: a job's kept checkpoints, newest first")
    def get(self, request: Request, job_id: str) -> Response:
        checkpoints = selectors.job_checkpoints(job=self.job(job_id)).select_related("job__tenant")
        rows, has_more = _newest_first(checkpoints, page_request(request), CHECKPOINT_PREFIX)
        return Response(list_body([checkpoint_object(row) for row in rows], has_more=has_more))
