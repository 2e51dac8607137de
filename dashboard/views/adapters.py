"""The adapter registry's pages: adapters, their versions, deployment and canary.

Every action is one serving.registry.services call with the user as the audit actor (`user:<name>`, as the
session-authenticated API records it); the page then shows the new state and its audit event.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from dashboard.tenancy import DashboardRequest, Role, dashboard_actor, dashboard_view
from serving.registry import selectors, services
from serving.registry.models import Adapter, AdapterVersion
from serving.contracts.errors import InvalidInput, ServiceError


# Active against canary: their gateway traffic over this window.
USAGE_COMPARISON_WINDOW = timedelta(hours=24)


@dashboard_view(Role.VIEWER)
def adapter_list_view(request: DashboardRequest) -> HttpResponse:
    adapters = selectors.adapter_list(tenant=request.dashboard.tenant)
    return render(request, "dashboard/adapters/list.html", {"adapters": adapters, "nav": "adapters"})


@require_POST
@dashboard_view(Role.MEMBER)
def adapter_create_view(request: DashboardRequest) -> HttpResponse:
    try:
        adapter = services.adapter_create(tenant=request.dashboard.tenant, name=request.POST.get("name", "").strip(),
                                          description=request.POST.get("description", "").strip())
    except ServiceError as error:
        messages.error(request, error.message)
        return redirect("dashboard:adapters")
    messages.success(request, f"Adapter {adapter.name} created; upload a version or train one.")
    return redirect("dashboard:adapter", adapter.name)


@dashboard_view(Role.VIEWER)
def adapter_detail_view(request: DashboardRequest, name: str) -> HttpResponse:
    adapter = selectors.adapter_get(tenant=request.dashboard.tenant, name=name)
    active, canary = selectors.adapter_served_prefetched(adapter)
    versions = selectors.versions_by_precedence(adapter.versions.all())
    rollback_to = selectors.adapter_rollback_target(adapter=adapter, active=active) if active else None
    served = [item.version for item in (active, canary) if item is not None]
    usage = selectors.usage_by_version(adapter=adapter, versions=served,
                                       since=timezone.now() - USAGE_COMPARISON_WINDOW) if served else {}
    return render(request, "dashboard/adapters/detail.html", {
        "active_usage": usage.get(active.version) if active else None,
        "canary_usage": usage.get(canary.version) if canary else None,
        "adapter": adapter, "versions": versions, "active": active, "canary": canary, "rollback_to": rollback_to,
        "canary_share": round(100 * canary.canary_weight) if canary else 0,
        "active_share": 100 - round(100 * canary.canary_weight) if canary else 100,
        "events": selectors.adapter_events(adapter=adapter)[:100], "nav": "adapters",
    })


def _percent_weight(raw: str) -> float:
    """The slider's percentage (0–100) as the service's share of traffic (0–1)."""
    try:
        return float(raw) / 100
    except ValueError:
        raise InvalidInput(f"The canary weight must be a percentage from 0 to 100, got '{raw}'.",
                           code="invalid_weight", param="weight") from None


def _act(request: DashboardRequest, name: str, action: Callable[[Adapter, str, str], Any], done: str) -> HttpResponse:
    """Runs one registry service call for the tenant's adapter `name`; the outcome is a flash message."""
    adapter = selectors.adapter_get(tenant=request.dashboard.tenant, name=name)
    try:
        action(adapter, dashboard_actor(request), request.POST.get("reason", "").strip())
    except ServiceError as error:
        messages.error(request, error.message)
    else:
        messages.success(request, done)
    return redirect("dashboard:adapter", adapter.name)


def _version(adapter: Adapter, request: HttpRequest) -> AdapterVersion:
    return selectors.adapter_version_get(adapter=adapter, version=request.POST.get("version", ""))


@require_POST
@dashboard_view(Role.MEMBER)
def adapter_upload_view(request: DashboardRequest, name: str) -> HttpResponse:
    files = request.FILES.getlist("files")

    def upload(adapter: Adapter, actor: str, reason: str) -> AdapterVersion:
        if not files:
            raise InvalidInput("Choose adapter_config.json and adapter_model.safetensors, or one .zip/.tar.gz.",
                               code="missing_file", param="files")
        return services.adapter_version_upload(adapter=adapter, files=files, actor=actor, reason=reason,
                                               version=request.POST.get("version", "").strip() or None)

    return _act(request, name, upload, "Version uploaded; deploy it or start a canary.")


@require_POST
@dashboard_view(Role.MEMBER)
def adapter_deploy_view(request: DashboardRequest, name: str) -> HttpResponse:
    return _act(request, name, lambda adapter, actor, reason: services.adapter_version_deploy(
        version=_version(adapter, request), actor=actor, reason=reason),
        f"Version {request.POST.get('version', '')} is active.")


@require_POST
@dashboard_view(Role.MEMBER)
def adapter_canary_view(request: DashboardRequest, name: str) -> HttpResponse:
    """Starts a canary (a version is named) or changes the running canary's weight (none is)."""
    raw = request.POST.get("weight", "")

    def canary(adapter: Adapter, actor: str, reason: str) -> AdapterVersion:
        weight = _percent_weight(raw)
        if request.POST.get("version"):
            return services.adapter_canary_start(version=_version(adapter, request), weight=weight, actor=actor,
                                                 reason=reason)
        return services.adapter_canary_set_weight(adapter=adapter, weight=weight, actor=actor, reason=reason)

    return _act(request, name, canary, f"The canary now receives {raw}% of the traffic.")


@require_POST
@dashboard_view(Role.MEMBER)
def adapter_promote_view(request: DashboardRequest, name: str) -> HttpResponse:
    return _act(request, name, lambda adapter, actor, reason: services.adapter_canary_promote(
        adapter=adapter, actor=actor, reason=reason), "The canary is promoted to active.")


@require_POST
@dashboard_view(Role.MEMBER)
def adapter_abort_view(request: DashboardRequest, name: str) -> HttpResponse:
    return _act(request, name, lambda adapter, actor, reason: services.adapter_canary_abort(
        adapter=adapter, actor=actor, reason=reason), "The canary is aborted; all traffic goes to the active version.")


@require_POST
@dashboard_view(Role.MEMBER)
def adapter_rollback_view(request: DashboardRequest, name: str) -> HttpResponse:
    return _act(request, name, lambda adapter, actor, reason: services.adapter_rollback(
        adapter=adapter, actor=actor, reason=reason, version=request.POST.get("version", "").strip() or None),
        "Rolled back.")


@require_POST
@dashboard_view(Role.MEMBER)
def adapter_archive_view(request: DashboardRequest, name: str) -> HttpResponse:
    return _act(request, name, lambda adapter, actor, reason: services.adapter_version_archive(
        version=_version(adapter, request), actor=actor, reason=reason),
        f"Version {request.POST.get('version', '')} is archived.")
