"""The playground: chat with the base model, an adapter or a pinned version, through the public gateway.

The page holds no model call: the browser calls `/v1/chat/completions` itself with a playground key
(docs/dashboard.md, "Decisions"), so quotas, canary weights, breakers and usage records all apply.
"""

from __future__ import annotations

from django.conf import settings
from django.http import HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_POST

from dashboard.tenancy import DashboardRequest, Role, dashboard_view
from serving import selectors
from serving.models import Adapter
from tenants import selectors as tenant_selectors
from tenants import services as tenant_services

PLAYGROUND_SESSION_KEY = "playground_keys"
PLAYGROUND_MAX_TOKENS = 64


def _model_choices(adapters: list[Adapter]) -> list[dict[str, str]]:
    """What the playground may call: the base, each deployed adapter (weighted), each served version pinned."""
    choices = [{"value": settings.BASE_MODEL_NAME, "label": f"Base model ({settings.BASE_MODEL_NAME})"}]
    for adapter in adapters:
        active, canary = selectors.adapter_served_prefetched(adapter)
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
    if not full_key or not tenant_selectors.api_key_is_live(tenant=tenant, full_key=full_key):
        _, full_key = tenant_services.playground_key_issue(tenant=tenant, user=request.user)
        keys[str(tenant.pk)] = full_key
        request.session[PLAYGROUND_SESSION_KEY] = keys
    return JsonResponse({"key": full_key})
