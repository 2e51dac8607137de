"""Dashboard pages of the adapter registry: adapters, their versions, deployment and canary.

Every action is one serving.services call with the user as the audit actor (`user:<name>`, as the
session-authenticated API records it); the page then shows the new state and its audit event.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from serving.wire.errors import InvalidInput, ServiceError
from serving import selectors, services
from serving.models import Adapter, AdapterVersion
from serving.usage import GROUP_BY, usage_summary
from tenants import selectors as tenant_selectors
from tenants import services as tenant_services
from tenants.api_keys import parse_key
from tenants.dashboard import DashboardRequest, Role, dashboard_actor, dashboard_view
from tenants.models import ApiKey


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


def _served_pair(adapter: Adapter) -> tuple[AdapterVersion | None, AdapterVersion | None]:
    """(active, canary) from the prefetched versions, without another query."""
    by_status = {item.status: item for item in adapter.versions.all() if item.is_served}
    return by_status.get(AdapterVersion.Status.ACTIVE), by_status.get(AdapterVersion.Status.CANARY)


@dashboard_view(Role.VIEWER)
def adapter_detail_view(request: DashboardRequest, name: str) -> HttpResponse:
    adapter = selectors.adapter_get(tenant=request.dashboard.tenant, name=name)
    active, canary = _served_pair(adapter)
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


# --- playground -------------------------------------------------------------------------------

PLAYGROUND_SESSION_KEY = "playground_keys"
PLAYGROUND_MAX_TOKENS = 64


def _model_choices(adapters: list[Adapter]) -> list[dict[str, str]]:
    """What the playground may call: the base, each deployed adapter (weighted), each served version pinned."""
    choices = [{"value": settings.BASE_MODEL_NAME, "label": f"Base model ({settings.BASE_MODEL_NAME})"}]
    for adapter in adapters:
        active, canary = _served_pair(adapter)
        if active is None:
            continue
        split = f", canary {canary.version} at {round(100 * canary.canary_weight)}%" if canary else ""
        choices.append({"value": adapter.name, "label": f"{adapter.name} (active {active.version}{split})"})
        for version in (active, canary):
            if version is not None:
                choices.append({"value": f"{adapter.name}@{version.version}",
                                "label": f"{adapter.name}@{version.version} ({version.status})"})
    return choices


@dashboard_view(Role.MEMBER)
def playground_view(request: DashboardRequest) -> HttpResponse:
    tenant = request.dashboard.tenant
    choices = _model_choices(list(selectors.adapter_list(tenant=tenant)))
    first_adapter = next((item["value"] for item in choices[1:] if "@" not in item["value"]), choices[0]["value"])
    return render(request, "dashboard/playground.html", {
        "choices": choices, "left": first_adapter, "right": settings.BASE_MODEL_NAME,
        "max_tokens": min(PLAYGROUND_MAX_TOKENS, tenant.tier.max_tokens_per_request),
        "tier_max_tokens": tenant.tier.max_tokens_per_request, "nav": "playground",
    })


@require_POST
@dashboard_view(Role.MEMBER)
def playground_key_view(request: DashboardRequest) -> JsonResponse:
    """The user's playground key for this tenant (inference scope), issued once per session.

    The browser calls `/v1` with it, so the playground's requests take the public path with its
    quotas and usage records. A key revoked meanwhile is replaced.
    """
    tenant = request.dashboard.tenant
    keys = request.session.get(PLAYGROUND_SESSION_KEY, {})
    full_key = keys.get(str(tenant.pk))
    parsed = parse_key(full_key) if full_key else None
    live = parsed is not None and ApiKey.objects.filter(tenant=tenant, prefix=parsed.prefix,
                                                        revoked_at__isnull=True).exists()
    if not live:
        _, full_key = tenant_services.playground_key_issue(tenant=tenant, user=request.user)
        keys[str(tenant.pk)] = full_key
        request.session[PLAYGROUND_SESSION_KEY] = keys
    return JsonResponse({"key": full_key})


# --- usage ------------------------------------------------------------------------------------

USAGE_PERIODS = (1, 7, 30, 90)


def _usage_period(request: HttpRequest) -> tuple[int, datetime]:
    try:
        days = int(request.GET.get("days", 7))
    except ValueError:
        days = 7
    days = days if days in USAGE_PERIODS else 7
    today = timezone.now().replace(hour=0, minute=0, second=0, microsecond=0)
    return days, today - timedelta(days=days - 1)


@dashboard_view(Role.VIEWER)
def usage_view(request: DashboardRequest) -> HttpResponse:
    tenant = request.dashboard.tenant
    days, start = _usage_period(request)
    by = {group: usage_summary(tenant=tenant, start=start, end=None, group_by=group) for group in GROUP_BY}
    key_names = dict(tenant_selectors.api_key_list(tenant=tenant).values_list("prefix", "name"))
    for row in by["key"]["data"]:
        row["name"] = key_names.get(row["api_key"], "")
    # The chart shows every day of the period, those without requests as zeros.
    counted = {row["day"]: row for row in by["day"]["data"]}
    chart = [counted.get(day, {"day": day, "requests": 0, "total_tokens": 0})
             for day in ((start + timedelta(days=n)).date().isoformat() for n in range(days))]
    return render(request, "dashboard/usage.html", {
        "days": days, "periods": USAGE_PERIODS, "totals": by["day"]["totals"], "by_day": by["day"]["data"],
        "chart": chart,
        "by_adapter": by["adapter"]["data"], "by_key": by["key"]["data"], "nav": "usage",
    })


@dashboard_view(Role.VIEWER)
def usage_csv_view(request: DashboardRequest) -> HttpResponse:
    """The usage table grouped by `group` (day, adapter or key) over the chosen period, as CSV."""
    group = request.GET.get("group", "day")
    if group not in GROUP_BY:
        group = "day"
    days, start = _usage_period(request)
    rows = usage_summary(tenant=request.dashboard.tenant, start=start, end=None, group_by=group)["data"]
    column = {"day": "day", "adapter": "adapter", "key": "api_key"}[group]
    response = HttpResponse(content_type="text/csv")
    response["Content-Disposition"] = (f'attachment; filename="usage-{request.dashboard.tenant.slug}-by-{group}-'
                                       f'{days}d.csv"')
    writer = csv.writer(response)
    writer.writerow([column, "requests", "prompt_tokens", "completion_tokens", "total_tokens"])
    for row in rows:
        writer.writerow([row[column] or "", row["requests"], row["prompt_tokens"], row["completion_tokens"],
                         row["total_tokens"]])
    return response
