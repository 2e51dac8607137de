"""The dashboard's overview page: it gathers what each app's selectors say about the tenant."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from serving import selectors as registry_selectors
from tenants.dashboard import Role, dashboard_view
from training import selectors as training_selectors
from training.models import Dataset, TrainingJob

RECENT_JOBS = 5


@dashboard_view(Role.VIEWER)
def overview_view(request: HttpRequest) -> HttpResponse:
    tenant = request.dashboard.tenant
    adapters = registry_selectors.adapter_list(tenant=tenant)
    deployed = []
    for adapter in adapters:
        served = {item.status: item for item in adapter.versions.all() if item.is_served}
        if served:
            deployed.append({"adapter": adapter, "active": served.get("active"), "canary": served.get("canary")})
    jobs = training_selectors.job_list(tenant=tenant)
    return render(request, "dashboard/overview.html", {
        "tier": tenant.tier, "deployed": deployed, "adapter_count": len(adapters),
        "jobs": jobs[:RECENT_JOBS],
        "running_jobs": jobs.filter(status__in=TrainingJob.ACTIVE_STATUSES).count(),
        "ready_datasets": training_selectors.dataset_list(tenant=tenant).filter(status=Dataset.Status.READY).count(),
        "nav": "overview",
    })
