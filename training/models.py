"""Datasets, training jobs, their events and their checkpoints.

State changes live in the service modules (training.datasets, jobs, concurrency, run, publishing); the
models hold what the database can enforce by itself (one checkpoint per job and step, one produced
version per job).
"""

from __future__ import annotations

from django.db import models

from serving.registry.models import AdapterVersion
from tenants.models import Tenant
from tenants.scoping import TenantScopedQuerySet


class Dataset(models.Model):
    """A tenant's JSONL file in blob storage, with the report of its validation."""

    class Status(models.TextChoices):
        UPLOADED = "uploaded", "Uploaded"
        VALIDATING = "validating", "Validating"
        READY = "ready", "Ready"
        INVALID = "invalid", "Invalid"

    class Format(models.TextChoices):
        CHAT = "chat", "Chat (messages)"
        COMPLETION = "completion", "Prompt / completion"
        TEXT = "text", "Plain text"
        PREFERENCE = "preference", "Preference pairs (DPO)"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="datasets")
    # The uploaded file's name, for people; the storage key never depends on it.
    filename = models.CharField(max_length=255)
    storage_key = models.CharField(max_length=512, unique=True)
    sha256 = models.CharField(max_length=64)
    size_bytes = models.PositiveBigIntegerField()
    format = models.CharField(max_length=16, choices=Format.choices, blank=True, default="")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.UPLOADED)
    num_examples = models.PositiveIntegerField(null=True, blank=True)
    # The validation report: errors with line numbers and codes, warnings, token statistics.
    report = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # When the validation task was handed to the broker, and when a worker first began it: the
    # periodic sweep re-sends a task that was never sent and ends a validation stuck past its timeout
    # (training.sweep.training_jobs_sweep).
    validation_queued_at = models.DateTimeField(null=True, blank=True)
    validation_started_at = models.DateTimeField(null=True, blank=True)
    validated_at = models.DateTimeField(null=True, blank=True)

    objects = TenantScopedQuerySet.as_manager()

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.filename} (#{self.pk})"


class TrainingJob(models.Model):
    """One LoRA training run on the shared base model, producing one adapter version.

    queued → running → succeeded | failed | cancelled, and paused ⇄ queued between (a pause, a
    resume). A queued job counts toward its tenant's concurrent-job limit from the moment its task
    is sent (`dispatched_at`); a paused one does not. See training.concurrency.training_jobs_dispatch
    for how waiting jobs start.
    """

    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        RUNNING = "running", "Running"
        PAUSED = "paused", "Paused"
        SUCCEEDED = "succeeded", "Succeeded"
        FAILED = "failed", "Failed"
        CANCELLED = "cancelled", "Cancelled"

    # Not ended: the job keeps its files (a dataset in use is not deleted) and its adapter name's room.
    ACTIVE_STATUSES = (Status.QUEUED, Status.RUNNING, Status.PAUSED)
    FINAL_STATUSES = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="training_jobs")
    # Deleting a dataset is refused while an active job uses it; finished jobs keep their record.
    dataset = models.ForeignKey(Dataset, on_delete=models.SET_NULL, null=True, related_name="training_jobs")
    validation_dataset = models.ForeignKey(
        Dataset, on_delete=models.SET_NULL, null=True, blank=True, related_name="validation_jobs"
    )
    # Share of the training examples held out for evaluation when no validation dataset is given.
    validation_fraction = models.FloatField(default=0.0)
    adapter_name = models.CharField(max_length=63)
    # The version to produce: as requested, or assigned (next patch) just before publishing, and
    # then kept, so a redelivered task publishes under the same one.
    version = models.CharField(max_length=64, blank=True, default="")
    # The version the tenant asked for ("" for the next patch, assigned when the job publishes).
    requested_version = models.CharField(max_length=64, blank=True, default="")
    base_model = models.CharField(max_length=200)
    # The base model's commit (a Hugging Face snapshot's hash) the job trains on; "" for a plain directory.
    base_model_revision = models.CharField(max_length=64, blank=True, default="")
    hyperparameters = models.JSONField(default=dict)
    seed = models.PositiveIntegerField()
    # The tenant's own key-value labels (OpenAI's `metadata`: up to 16 string pairs), kept as given.
    metadata = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)

    created_at = models.DateTimeField(auto_now_add=True)
    dispatched_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    # A pause asked of a running job: its run checkpoints and pauses the job before its next step
    # (training.run); cleared when the job is paused or resumed.
    pause_requested_at = models.DateTimeField(null=True, blank=True)

    # The run that holds the job: a token per task delivery and its heartbeat. A delivery may take
    # the job only when no other run's heartbeat is fresh (training.run.training_job_claim).
    lease_token = models.CharField(max_length=32, blank=True, default="")
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    # Set when a run gave the job back because its worker stopped cleanly (lease released, task sent
    # again, training.run); the next run's claim clears it. Meanwhile the job is running, waiting to resume.
    interrupted_at = models.DateTimeField(null=True, blank=True)

    step = models.PositiveIntegerField(default=0)
    total_steps = models.PositiveIntegerField(null=True, blank=True)
    epoch = models.FloatField(default=0.0)
    estimated_finish = models.DateTimeField(null=True, blank=True)
    train_loss = models.FloatField(null=True, blank=True)
    valid_loss = models.FloatField(null=True, blank=True)
    trained_tokens = models.PositiveBigIntegerField(default=0)

    error_code = models.CharField(max_length=64, blank=True, default="")
    error_message = models.TextField(blank=True, default="")

    adapter_version = models.OneToOneField(
        AdapterVersion, on_delete=models.SET_NULL, null=True, blank=True, related_name="training_job"
    )

    objects = TenantScopedQuerySet.as_manager()

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["tenant", "status"], name="training_job_by_tenant_status")]

    def __str__(self) -> str:
        return f"training job #{self.pk} ({self.tenant.slug}/{self.adapter_name}, {self.status})"

    @property
    def is_final(self) -> bool:
        return self.status in self.FINAL_STATUSES


class TrainingEvent(models.Model):
    """A line of a job's log: a message, or the metrics of one logging step."""

    TENANT_PATH = "job__tenant"

    class Level(models.TextChoices):
        INFO = "info", "Info"
        WARNING = "warning", "Warning"
        ERROR = "error", "Error"

    class Type(models.TextChoices):
        MESSAGE = "message", "Message"
        METRICS = "metrics", "Metrics"

    job = models.ForeignKey(TrainingJob, on_delete=models.CASCADE, related_name="events")
    level = models.CharField(max_length=8, choices=Level.choices, default=Level.INFO)
    type = models.CharField(max_length=8, choices=Type.choices, default=Type.MESSAGE)
    message = models.TextField()
    data = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantScopedQuerySet.as_manager()

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["job", "-id"], name="training_event_by_job")]

    def __str__(self) -> str:
        return f"job #{self.job_id} {self.level}: {self.message}"


class Checkpoint(models.Model):
    """Training state saved to blob storage at a step: what a redelivered task resumes from, and,
    beside it, the step's adapter as a servable artifact (training.checkpoint_artifacts)."""

    TENANT_PATH = "job__tenant"

    job = models.ForeignKey(TrainingJob, on_delete=models.CASCADE, related_name="checkpoints")
    step = models.PositiveIntegerField()
    # Storage prefix of the directory (adapter weights, optimizer, scheduler, RNG, data position).
    storage_prefix = models.CharField(max_length=512)
    metrics = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # The servable artifact (PEFT files and manifest.json, as a published version's) stored at
    # `artifact_prefix`, and its manifest's sha256; "" for a checkpoint saved before they were written.
    artifact_uri = models.CharField(max_length=1024, blank=True, default="")
    manifest_sha256 = models.CharField(max_length=64, blank=True, default="")

    objects = TenantScopedQuerySet.as_manager()

    class Meta:
        ordering = ["-step"]
        constraints = [models.UniqueConstraint(fields=["job", "step"], name="checkpoint_unique_job_step")]

    def __str__(self) -> str:
        return f"job #{self.job_id} step {self.step}"

    @property
    def artifact_prefix(self) -> str:
        """Where the servable artifact lives: beside the training state, never inside it (the two are
        published at once, and a directory published over another would replace it)."""
        return f"{self.storage_prefix}-adapter"

    @property
    def storage_prefixes(self) -> tuple[str, str]:
        """Everything stored for the checkpoint, which goes when it goes (retention, a cancel, a restart)."""
        return self.storage_prefix, self.artifact_prefix


class Upload(models.Model):
    """OpenAI's Upload: a file sent in parts, each one request, completed into a dataset (training.uploads).

    pending → completed | cancelled | expired. The parts are stored under the upload's own storage
    prefix until it ends; `dataset` is the file its completion made.
    """

    class Status(models.TextChoices):
        PENDING = "pending", "Pending"
        COMPLETED = "completed", "Completed"
        CANCELLED = "cancelled", "Cancelled"
        EXPIRED = "expired", "Expired"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="uploads")
    filename = models.CharField(max_length=255)
    purpose = models.CharField(max_length=32)
    mime_type = models.CharField(max_length=100)
    # What the tenant declared at creation; completion refuses any other total.
    size_bytes = models.PositiveBigIntegerField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    dataset = models.OneToOneField(Dataset, on_delete=models.SET_NULL, null=True, blank=True, related_name="upload")

    objects = TenantScopedQuerySet.as_manager()

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["status", "expires_at"], name="upload_by_status_expiry")]

    def __str__(self) -> str:
        return f"upload #{self.pk} ({self.tenant.slug}/{self.filename}, {self.status})"


class UploadPart(models.Model):
    """One part of an upload, stored with its size and sha256 (checked again when the upload completes)."""

    TENANT_PATH = "upload__tenant"

    upload = models.ForeignKey(Upload, on_delete=models.CASCADE, related_name="parts")
    storage_key = models.CharField(max_length=512, unique=True)
    size_bytes = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantScopedQuerySet.as_manager()

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"upload #{self.upload_id} part #{self.pk}"
