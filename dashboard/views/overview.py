"""The dashboard's overview page: it gathers what each app's selectors say about the tenant."""

from __future__ import annotations

from django.http import HttpResponse
from django.shortcuts import render
from django.utils import timezone

from dashboard.htmx import is_htmx
from dashboard.tenancy import DashboardRequest, Role, dashboard_view
from serving.registry import selectors as registry_selectors
from tenants.models import Tenant
from training import selectors as training_selectors
from training.models import Dataset

RECENT_JOBS = 5


def _quota(tenant: Tenant) -> dict[str, object]:
    """The last minute's gateway traffic against the tier's per-minute quotas, and today's tokens."""
    tier = tenant.tier
    minute = registry_selectors.usage_window(tenant=tenant, seconds=60)
    today = timezone.now().replace(hour=0, minute=0, second=0, microsecond=0)

    def share(used: int, limit: int) -> int:
        return min(100, round(100 * used / limit)) if limit else 0

    return {"tier": tier, "minute": minute, "today_tokens": registry_selectors.usage_tokens_since(tenant=tenant,
                                                                                                since=today),
            "requests_percent": share(minute["requests"], tier.requests_per_minute),
            "tokens_percent": share(minute["tokens"], tier.tokens_per_minute)}


@dashboard_view(Role.VIEWER)
def overview_view(request: DashboardRequest) -> HttpResponse:
    tenant = request.dashboard.tenant
    if is_htmx(request):
        return render(request, "dashboard/_quota.html", _quota(tenant))
    adapters = registry_selectors.adapter_list(tenant=tenant)
    deployed = []
    for adapter in adapters:
        active, canary = registry_selectors.adapter_served_prefetched(adapter)
        if active or canary:
            deployed.append({"adapter": adapter, "active": active, "canary": canary})
    jobs = training_selectors.job_list(tenant=tenant)
    return render(request, "dashboard/overview.html", _quota(tenant) | {
        "deployed": deployed, "adapter_count": len(adapters),
        "jobs": jobs[:RECENT_JOBS],
        "ready_datasets": training_selectors.dataset_list(tenant=tenant).filter(status=Dataset.Status.READY).count(),
        "nav": "overview",
    })
