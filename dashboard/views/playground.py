"""The playground: chat with the base model, an adapter, a pinned version or a job's checkpoint, through the
public gateway.

The page holds no model call: the browser calls `/v1/chat/completions` itself with a playground key
(docs/dashboard.md, "Decisions"), so quotas, canary weights, breakers and usage records all apply.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_POST

from dashboard.tenancy import DashboardRequest, Role, dashboard_view
from serving.gateway import catalog
from tenants import selectors as tenant_selectors
from tenants import services as tenant_services

PLAYGROUND_SESSION_KEY = "playground_keys"
PLAYGROUND_MAX_TOKENS = 64


_STATUS_WORDS = {"ready": "ready, not deployed", "deprecated": "deprecated"}


def _label(model: catalog.Servable) -> str:
    if model.kind == "base":
        base = settings.BASE_MODEL_NAME
        return f"Base model ({base})" if model.model == base else f"{model.model} (alias of {base})"
    if model.kind == "adapter":
        split = f", canary {model.canary} at {round(100 * model.canary_weight)}%" if model.canary else ""
        return f"{model.model} (active {model.version}{split})"
    if model.kind == "checkpoint":
        return f"{model.model} (job {model.status}, step {model.version})"
    return f"{model.model} ({_STATUS_WORDS.get(model.status or '', model.status)})"


def model_choices(tenant_id: int) -> list[dict[str, Any]]:
    """What the playground may call, grouped: everything the gateway serves to the tenant
    (serving.gateway.catalog.servable_models): the base model, each deployed adapter (its traffic
    split), each version not archived, pinned (ready and deprecated ones included), and each kept
    checkpoint of a training job (by its pinned name)."""
    groups = {"base": "Base model", "adapter": "Deployed adapters (active and canary by weight)",
              "pinned": "Pinned versions", "checkpoint": "Checkpoints of training jobs"}
    models = catalog.servable_models(tenant_id)
    return [{"kind": kind, "label": label, "choices": [{"value": model.model, "label": _label(model)}
                                         for model in models if model.kind == kind]}
            for kind, label in groups.items() if any(model.kind == kind for model in models)]


@dashboard_view(Role.MEMBER)
def playground_view(request: DashboardRequest) -> HttpResponse:
    tenant = request.dashboard.tenant
    groups = model_choices(tenant.pk)
    values = [choice["value"] for group in groups for choice in group["choices"]]
    deployed: list[dict[str, str]] = next((group["choices"] for group in groups if group["kind"] == "adapter"), [])
    # `?model=` preselects one the tenant may call (a job page's "Open in Playground" names a checkpoint).
    asked = request.GET.get("model", "")
    return render(request, "dashboard/playground.html", {
        "groups": groups, "left": asked if asked in values else deployed[0]["value"] if deployed else values[0],
        "right": settings.BASE_MODEL_NAME,
        "max_tokens": min(PLAYGROUND_MAX_TOKENS, tenant.tier.max_tokens_per_request),
        "tier_max_tokens": tenant.tier.max_tokens_per_request, "nav": "playground",
    })


@require_POST
@dashboard_view(Role.MEMBER)
def playground_key_view(request: DashboardRequest) -> JsonResponse:
    """The user's playground key for this tenant (inference scope), issued once per session.

    The browser calls `/v1` with it, so the playground's requests take the public path with its
    quotas and usage records. A key revoked meanwhile is replaced; signing out revokes it
    (playground_keys_revoke).
    """
    tenant = request.dashboard.tenant
    keys = request.session.get(PLAYGROUND_SESSION_KEY, {})
    full_key = keys.get(str(tenant.pk))
    if not full_key or not tenant_selectors.api_key_is_live(tenant=tenant, full_key=full_key):
        _, full_key = tenant_services.playground_key_issue(tenant=tenant, user=request.user)
        keys[str(tenant.pk)] = full_key
        request.session[PLAYGROUND_SESSION_KEY] = keys
    return JsonResponse({"key": full_key})


def playground_keys_revoke(sender: type, request: HttpRequest | None, user: User | None,
                           **kwargs: Any) -> None:
    """`user_logged_out` (the dashboard's and the admin's sign-out alike): the playground keys this
    session was handed are revoked before the session is emptied. The browser held their secrets,
    so a key that outlived the sign-out kept calling `/v1` for whoever had the page's memory or
    history (issue 37, item 8); a session that expires unsigned-out leaves its key to be replaced
    (each new one revokes the last) or revoked on the key page."""
    if request is None or user is None or not hasattr(request, "session"):
        return
    for tenant_id, full_key in request.session.get(PLAYGROUND_SESSION_KEY, {}).items():
        key = tenant_selectors.api_key_live(tenant_id=int(tenant_id), full_key=full_key, created_by=user)
        if key is not None:
            tenant_services.api_key_revoke(api_key=key, actor=f"user:{user.get_username()}",
                                           reason="its user signed out of the dashboard")
