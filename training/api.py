"""REST for datasets and training jobs, in shapes close to OpenAI's files and fine-tuning APIs.

Lists are in the one list shape of api.pagination, newest first, paged with `?limit=`
and `?after=<id>` as OpenAI's are. Views only translate HTTP to training.datasets and training.jobs calls
and back; every rule lives there.
"""

from __future__ import annotations

from typing import Any

from django.core.files.uploadhandler import TemporaryFileUploadHandler
from django.db.models import QuerySet
from django.http import HttpRequest
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, extend_schema_field, inline_serializer
from rest_framework import mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.parsers import MultiPartParser
from rest_framework.request import Request
from rest_framework.response import Response

from api.parsers import JSONParser
from api.schema import error_response
from serving.registry.api import VersionSerializer, request_actor
from training.checkpoint_versions import checkpoint_version_create
from serving.contracts.errors import InvalidInput, NotFound
from api.pagination import list_body, list_schema, page_request, paging_parameters, take
from tenants.scoping import TenantScopedViewSet
from training import conf, datasets, jobs, selectors
from serving.contracts.checkpoint_names import checkpoint_model_name, checkpoint_pinned_name
from training.models import Checkpoint, Dataset, TrainingEvent, TrainingJob

def _page(request: Request, queryset: QuerySet, serializer: type[serializers.Serializer]) -> Response:
    """One page of a list ordered newest first: `limit` rows with ids below `after`."""
    page = page_request(request)
    after = page.int_after()
    if after is not None:
        queryset = queryset.filter(pk__lt=after)
    rows, has_more = take(queryset.order_by("-id"), page.limit)
    serialized = serializer(rows, many=True).data  # a ReturnList (drf-stubs call it a ReturnDict)
    return Response(list_body(serialized, has_more=has_more))  # type: ignore[arg-type]


_PAGING = paging_parameters("the id")
_NO_SUCH_FILE = "No such dataset (training_file or validation_file) in the caller's tenant."


def _list_of(serializer: type[serializers.Serializer], name: str) -> serializers.Serializer:
    return list_schema(serializer, name, serializers.IntegerField)


# --- datasets ---------------------------------------------------------------------------------


class DatasetSerializer(serializers.ModelSerializer):
    object = serializers.SerializerMethodField()
    bytes = serializers.IntegerField(source="size_bytes")

    class Meta:
        model = Dataset
        fields = ["id", "object", "filename", "bytes", "sha256", "format", "status", "num_examples", "created_at",
                  "validated_at", "report"]
        read_only_fields = fields

    def get_object(self, dataset: Dataset) -> str:
        return "dataset"


class DatasetUploadSerializer(serializers.Serializer):
    file = serializers.FileField(help_text="The JSONL file: chat `messages`, `prompt`/`completion`, or `text` lines.")


class DatasetUploadHandler(TemporaryFileUploadHandler):
    """Streams an upload to a temporary file on disk and stops the moment it passes the tier's limit,
    deleting what it wrote.

    DRF authenticates before it parses the body and copies `auth` onto the Django request, so the
    tenant (and so the limit) is known when the first chunk arrives; the dashboard sets `auth` before
    its CSRF check parses the form (without it, the platform-wide limit applied: issue 37).
    """

    def __init__(self, request: HttpRequest) -> None:
        super().__init__(request)
        self.received = 0
        self.limit: int | None = None
        self.tenant = None

    def new_file(self, *args: Any, **kwargs: Any) -> None:
        super().new_file(*args, **kwargs)
        self.tenant = getattr(getattr(self.request, "auth", None), "tenant", None)
        self.limit = conf.dataset_max_bytes(self.tenant.tier.name) if self.tenant else conf.setting_int(
            "TRAINING_DATASET_MAX_BYTES")

    def receive_data_chunk(self, raw_data: bytes, start: int) -> bytes | None:
        self.received += len(raw_data)
        if self.limit is not None and self.received > self.limit:
            # The temporary file is a NamedTemporaryFile: closing it deletes it, so nothing of a
            # refused upload stays on disk while the error and its request are still referenced.
            self.file.close()
            raise datasets.dataset_too_large(None, self.limit, self.tenant)
        return super().receive_data_chunk(raw_data, start)


class DatasetViewSet(mixins.RetrieveModelMixin, TenantScopedViewSet):
    queryset = Dataset.objects.select_related("tenant")
    serializer_class = DatasetSerializer
    parser_classes = [MultiPartParser]

    def initialize_request(self, request: HttpRequest, *args: Any, **kwargs: Any) -> Request:
        if request.method == "POST":
            request.upload_handlers = [DatasetUploadHandler(request)]
        return super().initialize_request(request, *args, **kwargs)

    @extend_schema(parameters=_PAGING, responses=_list_of(DatasetSerializer, "DatasetList"),
                   summary="List datasets, newest first")
    def list(self, request: Request) -> Response:
        return _page(request, self.get_queryset(), DatasetSerializer)

    @extend_schema(request={"multipart/form-data": DatasetUploadSerializer}, responses={201: DatasetSerializer},
                   summary="Upload a JSONL dataset (validated in the background: uploaded → validating → ready | "
                           "invalid)")
    def create(self, request: Request) -> Response:
        upload = request.FILES.get("file")
        if upload is None:
            raise InvalidInput("Upload the JSONL file as the multipart form field 'file'.", code="missing_file",
                               param="file")
        dataset = datasets.dataset_create(tenant=self.tenant, source=upload, filename=upload.name, size=upload.size)
        return Response(DatasetSerializer(dataset).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses=DatasetSerializer, summary="Get a dataset with its validation report")
    def retrieve(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().retrieve(request, *args, **kwargs)

    @extend_schema(
        responses=inline_serializer("DatasetDeleted", {"id": serializers.IntegerField(),
                                                       "object": serializers.CharField(),
                                                       "deleted": serializers.BooleanField()}),
        summary="Delete a dataset and its file (refused while a queued, running or paused job uses it)",
    )
    def destroy(self, request: Request, pk: str) -> Response:
        dataset = self.get_object()
        datasets.dataset_delete(dataset=dataset)
        return Response({"id": dataset.pk, "object": "dataset", "deleted": True})


# --- training jobs ----------------------------------------------------------------------------


class TrainingJobSerializer(serializers.ModelSerializer):
    object = serializers.SerializerMethodField()
    model = serializers.CharField(source="base_model", help_text="The base model the adapter is trained on.")
    adapter = serializers.CharField(source="adapter_name")
    version = serializers.SerializerMethodField()
    fine_tuned_model = serializers.SerializerMethodField(
        help_text="Once succeeded: what to pass as `model` to use the produced version (`<adapter>@<version>`).")
    training_file = serializers.IntegerField(source="dataset_id", allow_null=True)
    validation_file = serializers.IntegerField(source="validation_dataset_id", allow_null=True)
    progress = serializers.SerializerMethodField()
    cancel_requested = serializers.SerializerMethodField()
    pause_requested = serializers.SerializerMethodField(
        help_text="A pause was asked of the running job: it saves a checkpoint and pauses before its next step.")
    interrupted = serializers.SerializerMethodField(
        help_text="Set while a running job waits for a worker after its worker stopped cleanly (it resumes as soon "
                  "as one runs): when it stopped, and the step it resumes from (its newest checkpoint; 0: the start).")
    error = serializers.SerializerMethodField()
    adapter_version = serializers.SerializerMethodField()

    class Meta:
        model = TrainingJob
        fields = ["id", "object", "status", "model", "adapter", "version", "fine_tuned_model", "training_file",
                  "validation_file", "validation_fraction", "hyperparameters", "seed", "progress", "trained_tokens",
                  "attempts", "cancel_requested", "pause_requested", "interrupted", "error", "adapter_version",
                  "created_at", "started_at", "finished_at"]
        read_only_fields = fields

    def get_object(self, job: TrainingJob) -> str:
        return "training_job"

    def get_version(self, job: TrainingJob) -> str | None:
        return job.version or None

    def get_fine_tuned_model(self, job: TrainingJob) -> str | None:
        return f"{job.adapter_name}@{job.version}" if job.status == TrainingJob.Status.SUCCEEDED else None

    @extend_schema_field(OpenApiTypes.OBJECT)
    def get_progress(self, job: TrainingJob) -> dict[str, Any]:
        finish = job.estimated_finish.isoformat() if job.estimated_finish else None
        return {"step": job.step, "total_steps": job.total_steps, "epoch": job.epoch, "estimated_finish": finish,
                "train_loss": job.train_loss, "valid_loss": job.valid_loss}

    def get_cancel_requested(self, job: TrainingJob) -> bool:
        return job.cancel_requested_at is not None

    def get_pause_requested(self, job: TrainingJob) -> bool:
        return job.pause_requested_at is not None

    @extend_schema_field(inline_serializer("TrainingJobInterruption", {
        "at": serializers.DateTimeField(), "resumes_from_step": serializers.IntegerField()}, allow_null=True))
    def get_interrupted(self, job: TrainingJob) -> dict[str, Any] | None:
        if job.interrupted_at is None or job.status != TrainingJob.Status.RUNNING:
            return None
        newest = job.checkpoints.order_by("-step").values_list("step", flat=True).first()
        return {"at": job.interrupted_at.isoformat(), "resumes_from_step": newest or 0}

    @extend_schema_field(OpenApiTypes.OBJECT)
    def get_error(self, job: TrainingJob) -> dict[str, Any] | None:
        if job.status != TrainingJob.Status.FAILED:
            return None
        return {"code": job.error_code, "message": job.error_message, "param": None}

    @extend_schema_field(OpenApiTypes.OBJECT)
    def get_adapter_version(self, job: TrainingJob) -> dict[str, Any] | None:
        version = job.adapter_version
        if version is None:
            return None
        return {"version": version.version, "status": version.status, "artifact_uri": version.artifact_uri,
                "manifest_sha256": version.manifest_sha256}


class TrainingJobCreateSerializer(serializers.Serializer):
    """Types only; the service checks everything else (and says what is wrong)."""

    training_file = serializers.IntegerField(help_text="Id of a ready dataset.")
    adapter = serializers.CharField(max_length=63, help_text="Adapter to produce a version of (created if new).")
    version = serializers.CharField(max_length=64, required=False, allow_blank=True, allow_null=True,
                                    help_text="Semantic version to produce; the next patch release when omitted.")
    validation_file = serializers.IntegerField(required=False, allow_null=True,
                                               help_text="Id of a ready dataset to compute the validation loss on.")
    validation_fraction = serializers.FloatField(required=False, allow_null=True,
                                                 help_text="Or: share of the training examples to hold out (≤ 0.5).")
    hyperparameters = serializers.DictField(
        required=False, allow_null=True,
        help_text="n_epochs, batch_size, learning_rate, max_seq_length, r, lora_alpha, lora_dropout, "
                  "target_modules (\"all-linear\" or a list), warmup_ratio, use_dora (a DoRA adapter), "
                  "base_quantization (\"int4\": QLoRA over the base's projections in INT4); omitted or "
                  "\"auto\" = default.")
    seed = serializers.IntegerField(required=False, allow_null=True)


class TrainingEventSerializer(serializers.ModelSerializer):
    object = serializers.SerializerMethodField()

    class Meta:
        model = TrainingEvent
        fields = ["id", "object", "created_at", "level", "type", "message", "data"]
        read_only_fields = fields

    def get_object(self, event: TrainingEvent) -> str:
        return "training_job.event"


class CheckpointSerializer(serializers.ModelSerializer):
    object = serializers.SerializerMethodField()
    step_number = serializers.IntegerField(source="step")
    training_job_id = serializers.IntegerField(source="job_id")
    model = serializers.SerializerMethodField(
        help_text="The `model` value that calls this checkpoint (`<adapter>@ftjob-<job>:ckpt-step-<N>`); null for "
                  "one saved before checkpoints had a servable artifact.")
    fine_tuned_model_checkpoint = serializers.SerializerMethodField(
        help_text="OpenAI's name of the same model (`ft:<base>:<tenant>:<adapter>:ftjob-<job>:ckpt-step-<N>`).")

    class Meta:
        model = Checkpoint
        fields = ["id", "object", "created_at", "step_number", "metrics", "training_job_id", "model",
                  "fine_tuned_model_checkpoint", "artifact_uri", "manifest_sha256"]
        read_only_fields = fields

    def get_object(self, checkpoint: Checkpoint) -> str:
        return "training_job.checkpoint"

    def get_model(self, checkpoint: Checkpoint) -> str | None:
        if not checkpoint.artifact_uri:
            return None
        return checkpoint_pinned_name(adapter=checkpoint.job.adapter_name, job_id=checkpoint.job_id,
                                      step=checkpoint.step)

    def get_fine_tuned_model_checkpoint(self, checkpoint: Checkpoint) -> str:
        job = checkpoint.job
        return checkpoint_model_name(base=job.base_model, tenant=job.tenant.slug, adapter=job.adapter_name,
                                     job_id=job.pk, step=checkpoint.step)


class CheckpointVersionSerializer(serializers.Serializer):
    version = serializers.CharField(max_length=64, required=False, allow_blank=True, allow_null=True,
                                    help_text="Semantic version to create; the next patch release when omitted.")
    reason = serializers.CharField(max_length=2000, required=False, allow_blank=True, default="",
                                   help_text="Why; kept in the audit log.")


class TrainingJobViewSet(mixins.RetrieveModelMixin, TenantScopedViewSet):
    queryset = TrainingJob.objects.select_related("tenant", "adapter_version")
    serializer_class = TrainingJobSerializer
    parser_classes = [JSONParser]

    @extend_schema(parameters=_PAGING, responses=_list_of(TrainingJobSerializer, "TrainingJobList"),
                   summary="List training jobs, newest first")
    def list(self, request: Request) -> Response:
        return _page(request, self.get_queryset(), TrainingJobSerializer)

    @extend_schema(request=TrainingJobCreateSerializer,
                   responses={201: TrainingJobSerializer, 404: error_response(_NO_SUCH_FILE)},
                   summary="Create a training job (queued; it starts when the tier's concurrent-job limit has room)")
    def create(self, request: Request) -> Response:
        payload = TrainingJobCreateSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        job = jobs.training_job_create(tenant=self.tenant, **payload.validated_data)
        return Response(TrainingJobSerializer(job).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses=TrainingJobSerializer, summary="Get a training job with its progress")
    def retrieve(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().retrieve(request, *args, **kwargs)

    @extend_schema(request=None, responses=TrainingJobSerializer,
                   summary="Cancel a job: a queued one at once, a running one before its next step")
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str) -> Response:
        job = jobs.training_job_cancel(job=self.get_object())
        return Response(TrainingJobSerializer(self.get_queryset().get(pk=job.pk)).data)

    @extend_schema(request=None, responses=TrainingJobSerializer,
                   summary="Pause a job: a queued one at once, a running one after a checkpoint before its next step")
    @action(detail=True, methods=["post"])
    def pause(self, request: Request, pk: str) -> Response:
        job = jobs.training_job_pause(job=self.get_object())
        return Response(TrainingJobSerializer(self.get_queryset().get(pk=job.pk)).data)

    @extend_schema(request=None, responses=TrainingJobSerializer,
                   summary="Resume a paused job from its newest checkpoint")
    @action(detail=True, methods=["post"])
    def resume(self, request: Request, pk: str) -> Response:
        job = jobs.training_job_resume(job=self.get_object())
        return Response(TrainingJobSerializer(self.get_queryset().get(pk=job.pk)).data)

    @extend_schema(parameters=_PAGING, responses=_list_of(TrainingEventSerializer, "TrainingEventList"),
                   summary="The job's events (messages and metrics), newest first")
    @action(detail=True, methods=["get"])
    def events(self, request: Request, pk: str) -> Response:
        return _page(request, selectors.job_events(job=self.get_object()), TrainingEventSerializer)

    @extend_schema(parameters=_PAGING, responses=_list_of(CheckpointSerializer, "CheckpointList"),
                   summary="The job's kept checkpoints, newest first")
    @action(detail=True, methods=["get"])
    def checkpoints(self, request: Request, pk: str) -> Response:
        checkpoints = selectors.job_checkpoints(job=self.get_object()).select_related("job__tenant")
        return _page(request, checkpoints, CheckpointSerializer)

    @extend_schema(request=CheckpointVersionSerializer, responses={201: VersionSerializer},
                   summary="Create a version of the job's adapter (status ready) from its kept checkpoint of a step")
    @action(detail=True, methods=["post"], url_path=r"checkpoints/(?P<step>[0-9]{1,18})/version")
    def checkpoint_version(self, request: Request, pk: str, step: str) -> Response:
        job = self.get_object()
        checkpoint = selectors.job_checkpoints(job=job).filter(step=int(step)).first()
        if checkpoint is None:
            raise NotFound(f"Training job {job.pk} keeps no checkpoint of step {step}.", code="checkpoint_not_found",
                           param="step")
        payload = CheckpointVersionSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        created = checkpoint_version_create(checkpoint=checkpoint, actor=request_actor(request),
                                            version=payload.validated_data.get("version") or None,
                                            reason=payload.validated_data["reason"])
        return Response(VersionSerializer(created).data, status=status.HTTP_201_CREATED)
