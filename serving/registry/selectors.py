"""Registry queries: adapters and versions of a tenant, what is served, the workers' snapshot, and
the resolution of a request's `model` to one version (for the gateway)."""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, Max, Prefetch, QuerySet, Sum
from django.utils import timezone

from serving.contracts.errors import NotFound
from serving.registry.models import Adapter, AdapterVersion, DeploymentEvent, UsageRecord
from serving.registry.versions import SemVer, version_next_patch
from serving.contracts.registry import RegistrySnapshot, ServedEntry
from tenants.models import Tenant

SERVED_STATUSES = (AdapterVersion.Status.ACTIVE, AdapterVersion.Status.CANARY)
_ACTIVATIONS = (DeploymentEvent.Kind.DEPLOY, DeploymentEvent.Kind.PROMOTE, DeploymentEvent.Kind.ROLLBACK)


def accepted_base_models() -> list[str]:
    """The base-model names an adapter may name: the platform's base and the operator's aliases."""
    return [settings.BASE_MODEL_NAME, *settings.BASE_MODEL_ALIASES]


def adapter_version_get(*, adapter: Adapter, version: str) -> AdapterVersion:
    found = adapter.versions.select_related("adapter__tenant").filter(version=version).first()
    if found is None:
        raise NotFound(f"Adapter '{adapter.name}' has no version '{version}'.", code="version_not_found",
                       param="version")
    return found


def versions_by_precedence(versions: QuerySet[AdapterVersion] | list[AdapterVersion]) -> list[AdapterVersion]:
    """Newest semantic version first."""
    return sorted(versions, key=lambda item: SemVer(item.version), reverse=True)


def adapter_version_next(*, tenant: Tenant, adapter_name: str) -> str:
    """The version a new release of the adapter should take (the next patch; 1.0.0 for the first)."""
    existing = AdapterVersion.objects.for_tenant(tenant).filter(adapter__name=adapter_name)
    return version_next_patch(existing.values_list("version", flat=True))


def adapter_served(*, adapter: Adapter) -> tuple[AdapterVersion | None, AdapterVersion | None]:
    """(active, canary) of the adapter, either may be None."""
    served = {item.status: item for item in adapter.versions.select_related("adapter__tenant")
              .filter(status__in=SERVED_STATUSES)}
    return served.get(AdapterVersion.Status.ACTIVE), served.get(AdapterVersion.Status.CANARY)


def adapter_served_prefetched(adapter: Adapter) -> tuple[AdapterVersion | None, AdapterVersion | None]:
    """(active, canary) from the versions adapter_list and adapter_get prefetched, without a query."""
    served = {item.status: item for item in adapter.versions.all() if item.is_served}
    return served.get(AdapterVersion.Status.ACTIVE), served.get(AdapterVersion.Status.CANARY)


def served_weight(version: AdapterVersion, canary: AdapterVersion | None) -> float:
    """The share of the adapter's traffic a served version receives."""
    if version.status == AdapterVersion.Status.CANARY:
        return version.canary_weight
    # Rounded so that 1 - 0.7 reads 0.3 in events, snapshots and exported files.
    return round(1.0 - canary.canary_weight, 9) if canary is not None else 1.0


def version_entry(version: AdapterVersion, *, weight: float | None) -> ServedEntry:
    """How the snapshot and the deploy events describe one version to serving workers."""
    return ServedEntry(
        name=version.qualified_name, tenant=version.adapter.tenant.slug, adapter=version.adapter.name,
        version=version.version, status=version.status, weight=weight, artifact_uri=version.artifact_uri,
        manifest_sha256=version.manifest_sha256, base_model=version.base_model,
        base_model_revision=version.base_model_revision, rank=version.rank,
    )


def adapter_served_entries(*, adapter: Adapter) -> list[ServedEntry]:
    active, canary = adapter_served(adapter=adapter)
    return [version_entry(item, weight=served_weight(item, canary)) for item in (active, canary) if item]


def registry_snapshot() -> dict[str, Any]:
    """Everything serving workers should keep resident: every active and canary version.

    `revision` is the id of the newest audit event; a worker that saw events up to that id has
    missed nothing. Suspended tenants' versions are left out, as their requests are refused.
    """
    revision = DeploymentEvent.objects.aggregate(last=Max("id"))["last"] or 0
    served = (
        AdapterVersion.objects.filter(status__in=SERVED_STATUSES, adapter__tenant__status=Tenant.Status.ACTIVE)
        .select_related("adapter__tenant")
        .order_by("adapter__tenant__slug", "adapter__name", "status")
    )
    canaries = {item.adapter_id: item for item in served if item.status == AdapterVersion.Status.CANARY}
    return RegistrySnapshot(
        revision=revision, base_model=settings.BASE_MODEL_NAME, base_model_revision=settings.BASE_MODEL_REVISION,
        adapters=[version_entry(item, weight=served_weight(item, canaries.get(item.adapter_id))) for item in served],
    ).to_dict()


def adapter_rollback_target(*, adapter: Adapter, active: AdapterVersion) -> str | None:
    """The version a rollback from `active` returns to, by the audit log; None if there is none.

    It is the version `active` replaced when it was last activated by a deploy or promote. A
    rollback's own activation is skipped, so repeated rollbacks walk further back (v3 → v2 → v1)
    instead of flipping between two versions.
    """
    activations = (
        DeploymentEvent.objects.filter(adapter=adapter, kind__in=_ACTIVATIONS, to_version=active.version)
        .exclude(kind=DeploymentEvent.Kind.ROLLBACK)
        .order_by("-id")
        .values_list("from_version", flat=True)
    )
    previous = activations.first()
    return previous or None


def adapter_events(*, adapter: Adapter) -> QuerySet[DeploymentEvent]:
    return adapter.events.select_related("tenant").order_by("-id")


def adapter_list(*, tenant: Tenant) -> QuerySet[Adapter]:
    """The tenant's adapters with every version prefetched (active and canary read without a query each)."""
    return (Adapter.objects.for_tenant(tenant).select_related("tenant")
            .prefetch_related(Prefetch("versions", queryset=AdapterVersion.objects.order_by("-created_at", "-id")))
            .order_by("name"))


def adapter_get(*, tenant: Tenant, name: str) -> Adapter:
    """The tenant's adapter by name; another tenant's is as missing as one that never existed."""
    adapter = adapter_list(tenant=tenant).filter(name=name).first()
    if adapter is None:
        raise NotFound(f"No adapter named '{name}'.", code="adapter_not_found", param="name")
    return adapter


def usage_window(*, tenant: Tenant, seconds: int) -> dict[str, int]:
    """Requests and tokens of the tenant's gateway calls in the last `seconds` (the overview's live meters)."""
    since = timezone.now() - timedelta(seconds=seconds)
    totals = UsageRecord.objects.for_tenant(tenant).filter(created_at__gte=since).aggregate(
        requests=Count("id"), prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"))
    return {"requests": totals["requests"], "tokens": (totals["prompt"] or 0) + (totals["completion"] or 0)}


def usage_tokens_since(*, tenant: Tenant, since: datetime) -> int:
    totals = UsageRecord.objects.for_tenant(tenant).filter(created_at__gte=since).aggregate(
        prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"))
    return (totals["prompt"] or 0) + (totals["completion"] or 0)


def usage_tokens_by_key_since(*, tenant: Tenant, since: datetime) -> dict[str, int]:
    """The tenant's recorded tokens since `since` per API key prefix (the keys page's month's spend)."""
    rows = (UsageRecord.objects.for_tenant(tenant).filter(created_at__gte=since).values("api_key_prefix")
            .annotate(prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens")))
    return {row["api_key_prefix"]: (row["prompt"] or 0) + (row["completion"] or 0) for row in rows}


def usage_by_version(*, adapter: Adapter, versions: list[str], since: datetime) -> dict[str, dict[str, Any]]:
    """Per version of the adapter since `since`: requests, error rate, p50/p95 latency (ms), tokens.

    One query for all the versions; percentiles are taken here (nearest rank), the same on every
    database. A version without requests gets zeros and None latencies.
    """
    rows = (UsageRecord.objects.for_tenant(adapter.tenant)
            .filter(adapter=adapter.name, version__in=versions, created_at__gte=since)
            .values_list("version", "status", "latency_ms", "prompt_tokens", "completion_tokens"))
    grouped: dict[str, list[tuple]] = {version: [] for version in versions}
    for row in rows:
        grouped[row[0]].append(row)
    return {version: _usage_stats(items) for version, items in grouped.items()}


def _usage_stats(rows: list[tuple]) -> dict[str, Any]:
    latencies = sorted(row[2] for row in rows)
    errors = sum(1 for row in rows if row[1] == UsageRecord.Status.UPSTREAM_ERROR)

    def percentile(share: float) -> float | None:
        if not latencies:
            return None
        return latencies[max(0, math.ceil(share * len(latencies)) - 1)]

    return {"requests": len(rows), "errors": errors, "error_rate": errors / len(rows) if rows else 0.0,
            "p50_ms": percentile(0.50), "p95_ms": percentile(0.95),
            "tokens": sum(row[3] + row[4] for row in rows)}
