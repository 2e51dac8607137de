"""Tenants, their tiers (quotas), memberships and API keys."""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.db import models


class Tier(models.Model):
    """A service level: the quotas and priority every tenant on it shares."""

    name = models.SlugField(max_length=32, unique=True)
    requests_per_minute = models.PositiveIntegerField()
    tokens_per_minute = models.PositiveIntegerField()
    max_tokens_per_request = models.PositiveIntegerField()
    # Lower runs first, as in the engine's scheduler.
    priority = models.PositiveSmallIntegerField()
    max_concurrent_training_jobs = models.PositiveSmallIntegerField()
    max_adapters = models.PositiveIntegerField()
    # GPUs one training job may ask for (its `gpus` hyperparameter); more is refused at creation.
    max_gpus_per_job = models.PositiveSmallIntegerField(default=1)
    # Over quota, may a request run on the base model instead of being refused with 429?
    degradation_allowed = models.BooleanField(default=False)

    class Meta:
        ordering = ["priority", "name"]

    def __str__(self) -> str:
        return self.name


class Tenant(models.Model):
    class Status(models.TextChoices):
        ACTIVE = "active", "Active"
        SUSPENDED = "suspended", "Suspended"

    slug = models.SlugField(max_length=63, unique=True)
    name = models.CharField(max_length=200)
    tier = models.ForeignKey(Tier, on_delete=models.PROTECT, related_name="tenants")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug

    @property
    def is_active(self) -> bool:
        return self.status == self.Status.ACTIVE


class Membership(models.Model):
    class Role(models.TextChoices):
        OWNER = "owner", "Owner"
        MEMBER = "member", "Member"
        VIEWER = "viewer", "Viewer"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "tenant"], name="membership_unique_user_tenant")]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant} ({self.role})"


class ApiKey(models.Model):
    """A tenant's API key. The secret is shown once; only its hash is kept."""

    class Scope(models.TextChoices):
        INFERENCE = "inference", "Inference"
        MANAGE = "manage", "Manage"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    # The public part of `lp-<prefix>.<secret>`: how a presented key is found without scanning.
    prefix = models.CharField(max_length=16, unique=True)
    secret_hash = models.CharField(max_length=64)
    scopes = models.JSONField(default=list)
    # Who made it (a tenant owner, or the user a playground key is for): removing that member from
    # the tenant revokes it. None for the operator's keys (`tenant_create`, `manage.py tenants`).
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True,
                                   related_name="created_api_keys")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # The key's own controls (docs/keys.md), each unset by default: from `expires_at` on it is
    # refused (401 key_expired); a non-empty `allowed_models` names the only models it may call
    # (403 model_not_allowed); its rpm/tpm apply beside the tier's, never above them; once the
    # calendar month's (UTC) recorded tokens reach `monthly_token_budget` it gets 429
    # key_budget_exceeded until the month ends.
    expires_at = models.DateTimeField(null=True, blank=True)
    allowed_models = models.JSONField(default=list, blank=True)
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)
    monthly_token_budget = models.PositiveBigIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"lp-{self.prefix}… ({self.name})"

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None

    def is_expired(self, now: datetime) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes


class TenantEvent(models.Model):
    """The audit log of a tenant's access: its keys and its tier, one row per change, written in the
    change's transaction (the registry's is serving.registry.models.DeploymentEvent)."""

    class Kind(models.TextChoices):
        KEY_CREATE = "key_create", "API key created"
        KEY_UPDATE = "key_update", "API key limits changed"
        KEY_REVOKE = "key_revoke", "API key revoked"
        TIER_CHANGE = "tier_change", "Tier changed"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="events")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    # What changed: `lp-<prefix>… (<name>)` for a key, the tier's name for a tier change.
    subject = models.CharField(max_length=200)
    # Each changed field's old and new value: {"field": [old, new]}.
    changes = models.JSONField(default=dict, blank=True)
    # Who: `user:<username>`, `api-key:<prefix>`, `admin:<username>`, `operator:<os user>`.
    actor = models.CharField(max_length=200)
    reason = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"{self.tenant.slug} {self.kind} {self.subject}"
