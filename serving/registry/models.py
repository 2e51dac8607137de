"""The adapter registry: adapters, their versions, and the audit log of every deployment change.

State rules live in serving.registry.services; the constraints below are the part the database can hold by
itself (one active and one canary version per adapter, weights within 0–1, a weight only on a
canary), so even a buggy caller cannot store an impossible state.
"""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models import Q

from serving.contracts import names
from tenants.models import Tenant
from tenants.scoping import TenantScopedQuerySet

ADAPTER_NAME_PATTERN = r"[a-z0-9](?:[a-z0-9_-]{0,61}[a-z0-9])?"


def artifact_prefix(*, tenant: str, adapter: str, version: str | None = None) -> str:
    """Where an adapter's artifacts are stored: `adapters/<tenant>/<adapter>/` (every version, with
    the slash) or `adapters/<tenant>/<adapter>/<version>` (one version's directory). The registry
    and training both build keys here, so the layout of docs/registry.md is spelled once."""
    base = f"adapters/{tenant}/{adapter}/"
    return base if version is None else f"{base}{version}"


class Adapter(models.Model):
    """A tenant's named adapter (`support-bot`); what the `model` field of a request names."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="adapters")
    name = models.CharField(max_length=63)
    description = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantScopedQuerySet.as_manager()

    class Meta:
        ordering = ["tenant__slug", "name"]
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="adapter_unique_name_per_tenant")]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.name}"

    @property
    def storage_prefix(self) -> str:
        return artifact_prefix(tenant=self.tenant.slug, adapter=self.name)


class AdapterVersion(models.Model):
    """One immutable artifact of an adapter, and where it stands in the deployment lifecycle.

    ready → (deploy) active → (replaced) deprecated; ready/deprecated → (canary start) canary →
    (promote) active | (abort) deprecated; any version not served → archived, which is final.
    """

    TENANT_PATH = "adapter__tenant"

    class Status(models.TextChoices):
        READY = "ready", "Ready"
        ACTIVE = "active", "Active"
        CANARY = "canary", "Canary"
        DEPRECATED = "deprecated", "Deprecated"
        ARCHIVED = "archived", "Archived"

    class Source(models.TextChoices):
        TRAINING_JOB = "training_job", "Training job"
        UPLOAD = "upload", "Upload"

    class AdapterKind(models.TextChoices):
        """What the artifact is (docs/adapter-kinds.md); the engine reads it from adapter_config.json."""

        LORA = "lora", "LoRA"
        DORA = "dora", "DoRA"

    adapter = models.ForeignKey(Adapter, on_delete=models.CASCADE, related_name="versions")
    version = models.CharField(max_length=64)
    # Where serving workers fetch the PEFT directory from (file://… or s3://…), ending in '/'.
    artifact_uri = models.CharField(max_length=1024)
    # sha256 of manifest.json, which holds every file's sha256: the artifact's content identity.
    manifest_sha256 = models.CharField(max_length=64)
    base_model = models.CharField(max_length=200)
    # The base model's commit the adapter was trained or checked on (a Hugging Face snapshot's hash;
    # "" for a plain directory): only a base of that revision serves it.
    base_model_revision = models.CharField(max_length=64, blank=True, default="")
    rank = models.PositiveSmallIntegerField()
    lora_alpha = models.FloatField()
    target_modules = models.JSONField(default=list)
    kind = models.CharField(max_length=8, choices=AdapterKind.choices, default=AdapterKind.LORA)
    size_bytes = models.PositiveBigIntegerField()
    source = models.CharField(max_length=16, choices=Source.choices)
    source_id = models.CharField(max_length=64, blank=True, default="")
    # A version made from a training job's checkpoint (training.checkpoint_versions): that checkpoint's
    # step (the job is source_id); None for a job's final adapter and for uploads.
    source_checkpoint_step = models.PositiveIntegerField(null=True, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.READY)
    # The canary's share of the adapter's traffic; None for every other status.
    traffic_weight = models.FloatField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantScopedQuerySet.as_manager()

    class Meta:
        ordering = ["adapter_id", "-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["adapter", "version"], name="adapter_version_unique_version"),
            models.UniqueConstraint(
                fields=["adapter"], condition=Q(status="active"), name="adapter_version_one_active"
            ),
            models.UniqueConstraint(
                fields=["adapter"], condition=Q(status="canary"), name="adapter_version_one_canary"
            ),
            models.CheckConstraint(
                condition=Q(traffic_weight__isnull=True) | Q(traffic_weight__gte=0.0, traffic_weight__lte=1.0),
                name="adapter_version_weight_within_0_1",
            ),
            models.CheckConstraint(
                condition=(Q(status="canary") & Q(traffic_weight__isnull=False))
                | (~Q(status="canary") & Q(traffic_weight__isnull=True)),
                name="adapter_version_weight_only_on_canary",
            ),
        ]

    def __str__(self) -> str:
        return self.qualified_name

    @property
    def qualified_name(self) -> str:
        """`<tenant>/<adapter>@<version>`: how serving workers and the gateway name a version."""
        return names.qualified_name(tenant=self.adapter.tenant.slug, adapter=self.adapter.name, version=self.version)

    @property
    def is_served(self) -> bool:
        return self.status in (self.Status.ACTIVE, self.Status.CANARY)

    @property
    def canary_weight(self) -> float:
        """A canary's traffic weight, which a canary always has (adapter_version_weight_only_on_canary)."""
        if self.traffic_weight is None:
            raise ValueError(f"{self.qualified_name} is {self.status}, not a canary: it has no traffic weight.")
        return self.traffic_weight


class DeploymentEvent(models.Model):
    """The audit log: one row per state change of the registry, written in the same transaction.

    Versions are kept by their text, and the adapter link may go null, so the record of what was
    served survives the deletion of the adapter itself.
    """

    class Kind(models.TextChoices):
        REGISTER = "register", "Version registered"
        DEPLOY = "deploy", "Deploy"
        CANARY_START = "canary_start", "Canary start"
        CANARY_WEIGHT = "canary_weight", "Canary weight change"
        PROMOTE = "promote", "Promote canary"
        ROLLBACK = "rollback", "Rollback"
        ABORT = "abort", "Abort canary"
        ARCHIVE = "archive", "Archive"
        DELETE = "delete", "Adapter deleted"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="deployment_events")
    adapter = models.ForeignKey(Adapter, on_delete=models.SET_NULL, null=True, blank=True, related_name="events")
    adapter_name = models.CharField(max_length=63)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    from_version = models.CharField(max_length=64, blank=True, default="")
    to_version = models.CharField(max_length=64, blank=True, default="")
    from_weight = models.FloatField(null=True, blank=True)
    to_weight = models.FloatField(null=True, blank=True)
    # Who: `api-key:<prefix>`, `user:<username>`, `admin:<username>`, `training-job:<id>`, `operator:<what>`.
    actor = models.CharField(max_length=200)
    reason = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantScopedQuerySet.as_manager()

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["adapter", "-id"], name="deployment_event_by_adapter")]

    def __str__(self) -> str:
        change = " → ".join(part for part in (self.from_version, self.to_version) if part)
        return f"{self.tenant.slug}/{self.adapter_name} {self.kind} {change}".strip()


def usage_record_id() -> str:
    return uuid.uuid4().hex


class UsageRecord(models.Model):
    """One request through the public gateway: who asked, what served it, what it used.

    Written in batches off the request path (serving.contracts.usage_log); the adapter and version are
    kept as text so usage survives the deletion of an adapter, like the audit log.
    """

    class Status(models.TextChoices):
        OK = "ok", "OK"
        CLIENT_ERROR = "client_error", "Client error"
        ABORTED = "aborted", "Client went away"
        UPSTREAM_ERROR = "upstream_error", "Upstream error"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="usage_records")
    # The key's public prefix (`lp-<prefix>…`); text, so revoking or deleting a key keeps its usage.
    api_key_prefix = models.CharField(max_length=16)
    # The record's own id, minted by the gateway with it: a record pushed twice is written once.
    record_id = models.CharField(max_length=64, unique=True, default=usage_record_id)
    # The request's X-Request-ID (serving.contracts.request_ids), as in both processes' access lines; the
    # caller may have chosen it, so it may repeat.
    request_id = models.CharField(max_length=64, db_index=True)
    endpoint = models.CharField(max_length=32)
    # What the caller asked for (`support-bot`), and what served it (empty for the base model).
    model = models.CharField(max_length=200)
    adapter = models.CharField(max_length=63, blank=True, default="")
    version = models.CharField(max_length=64, blank=True, default="")
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    status = models.CharField(max_length=16, choices=Status.choices)
    http_status = models.PositiveSmallIntegerField()
    latency_ms = models.FloatField()
    ttft_ms = models.FloatField(null=True, blank=True)
    degraded = models.BooleanField(default=False)
    worker = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(db_index=True)

    objects = TenantScopedQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["tenant", "created_at"], name="usage_by_tenant_time")]

    def __str__(self) -> str:
        return f"{self.tenant.slug} {self.model} {self.prompt_tokens}+{self.completion_tokens} ({self.status})"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
