"""The tenant's people and access: its API keys (create with their own limits, change the limits, list
with this month's spend, revoke; docs/keys.md) and its members (add, role, remove)."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse, QueryDict
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from dashboard.tenancy import DashboardRequest, Role, dashboard_actor, dashboard_view
from serving.registry import selectors as serving_selectors
from serving.gateway import catalog
from serving.gateway.key_budget import Month
from serving.contracts.errors import InvalidInput, ServiceError
from tenants import selectors, services
from tenants.models import ApiKey, Membership, Tenant
from tenants.permissions import KEY_MANAGER_ROLE


def _keys_page(request: DashboardRequest, *, created: tuple[ApiKey, str] | None = None,
               error: ServiceError | None = None, error_key: int | None = None, status: int = 200) -> HttpResponse:
    tenant = request.dashboard.tenant
    month = Month.of(time.time())
    spent = serving_selectors.usage_tokens_by_key_since(
        tenant=tenant, since=datetime.fromtimestamp(month.start, tz=UTC))
    adapters = set(serving_selectors.adapter_list(tenant=tenant).values_list("name", flat=True))
    base_names = set(catalog.base_model_ids())
    now = timezone.now()
    keys = [{"key": key, "spent": spent.get(key.prefix, 0), "expired": key.is_expired(now),
             "budget_percent": min(100, round(100 * spent.get(key.prefix, 0) / key.monthly_token_budget))
             if key.monthly_token_budget else None,
             # Allow-list entries that name nothing the tenant has (a typo, or an adapter not made yet).
             "unknown_models": [name for name in key.allowed_models
                                if name not in base_names and name.partition("@")[0] not in adapters]}
            for key in selectors.api_key_list(tenant=tenant)]
    return render(request, "dashboard/keys.html", {
        "keys": keys, "scopes": ApiKey.Scope.choices, "tier": tenant.tier, "month": month.name,
        "created": created[0] if created else None, "created_secret": created[1] if created else None,
        "error": error, "error_key": error_key, "events": _events(tenant),
        "form": request.POST if error is not None else {}, "nav": "keys",
    }, status=status)


def _shown(value: Any) -> str:
    if value is None or value == []:
        return "none"
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)


def _events(tenant: Tenant) -> list[dict[str, Any]]:
    """The audit log's last changes: each event, and what it changed in words."""
    return [{"event": event, "changed": [f"{field.replace('_', ' ')}: {_shown(old)} → {_shown(new)}"
                                         for field, (old, new) in event.changes.items()]}
            for event in selectors.tenant_events(tenant=tenant)[:20]]


def _form_number(post: QueryDict, name: str) -> int | None:
    raw = post.get(name, "").strip().replace(",", "").replace("_", "")
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise InvalidInput(f"{name.replace('_', ' ')} must be a whole number (or empty for none), got '{raw}'.",
                           code="invalid_key_limit", param=name) from None


def _form_expiry(raw: str) -> datetime | None:
    """The form's `datetime-local` value, read as UTC (the page says so)."""
    raw = raw.strip()
    if not raw:
        return None
    try:
        moment = datetime.fromisoformat(raw)
    except ValueError:
        raise InvalidInput(f"The expiry must be a date and time, got '{raw}'.", code="invalid_expiry",
                           param="expires_at") from None
    return moment if timezone.is_aware(moment) else moment.replace(tzinfo=UTC)


def _form_controls(post: QueryDict, current: ApiKey | None = None) -> dict[str, Any]:
    """The key controls a keys-page form holds; on an edit, only those that differ from `current`
    (an expired key's unchanged expiry is not re-checked as if newly set)."""
    models = [name.strip() for line in post.get("allowed_models", "").splitlines() for name in line.split(",")]
    controls: dict[str, Any] = {
        "expires_at": _form_expiry(post.get("expires_at", "")),
        "allowed_models": [name for name in models if name],
        "requests_per_minute": _form_number(post, "requests_per_minute"),
        "tokens_per_minute": _form_number(post, "tokens_per_minute"),
        "monthly_token_budget": _form_number(post, "monthly_token_budget"),
    }
    if current is None:
        return controls

    def same(name: str, value: Any) -> bool:
        old = getattr(current, name)
        if name == "expires_at" and old is not None and value is not None:
            return old.replace(second=0, microsecond=0) == value.replace(second=0, microsecond=0)
        return bool(old == value)

    return {name: value for name, value in controls.items() if not same(name, value)}


@dashboard_view(Role.VIEWER)
def api_key_list_view(request: DashboardRequest) -> HttpResponse:
    return _keys_page(request)


@require_POST
@dashboard_view(KEY_MANAGER_ROLE)
def api_key_create_view(request: DashboardRequest) -> HttpResponse:
    """Answers with the page itself, not a redirect: the full key is in this response and nowhere else."""
    try:
        created = services.api_key_create(tenant=request.dashboard.tenant, name=request.POST.get("name", ""),
                                          scopes=request.POST.getlist("scopes"), created_by=request.user,
                                          controls=_form_controls(request.POST), actor=dashboard_actor(request),
                                          reason=request.POST.get("reason", ""))
    except ServiceError as error:
        return _keys_page(request, error=error, status=400)
    return _keys_page(request, created=created)


def _key(request: DashboardRequest, key_id: int) -> ApiKey:
    key = selectors.api_key_list(tenant=request.dashboard.tenant).filter(pk=key_id).first()
    if key is None:
        raise Http404(f"No API key {key_id}.")
    return key


@require_POST
@dashboard_view(KEY_MANAGER_ROLE)
def api_key_update_view(request: DashboardRequest, key_id: int) -> HttpResponse:
    key = _key(request, key_id)
    try:
        controls = _form_controls(request.POST, current=key)
        services.api_key_update(api_key=key, controls=controls, actor=dashboard_actor(request),
                                reason=request.POST.get("reason", ""))
    except ServiceError as error:
        return _keys_page(request, error=error, error_key=key.pk, status=400)
    changed = ", ".join(name.replace("_", " ") for name in controls)
    messages.success(request, f"Key lp-{key.prefix}… ({key.name}): " + (f"{changed} saved." if changed else
                                                                       "nothing to change."))
    return redirect("dashboard:keys")


@require_POST
@dashboard_view(KEY_MANAGER_ROLE)
def api_key_revoke_view(request: DashboardRequest, key_id: int) -> HttpResponse:
    key = _key(request, key_id)
    services.api_key_revoke(api_key=key, actor=dashboard_actor(request), reason=request.POST.get("reason", ""))
    messages.success(request, f"Key lp-{key.prefix}… ({key.name}) is revoked; requests with it are refused.")
    return redirect("dashboard:keys")


@dashboard_view(Role.VIEWER)
def member_list_view(request: DashboardRequest) -> HttpResponse:
    return render(request, "dashboard/members.html", {
        "members": selectors.membership_list(tenant=request.dashboard.tenant), "roles": Membership.Role.choices,
        "nav": "members",
    })


def _member(request: DashboardRequest, membership_id: int) -> Membership:
    membership = selectors.membership_list(tenant=request.dashboard.tenant).filter(pk=membership_id).first()
    if membership is None:
        raise Http404(f"No member {membership_id}.")
    return membership


def _member_action(request: HttpRequest, action: Callable[[], object], done: str) -> HttpResponse:
    try:
        action()
    except ServiceError as error:
        messages.error(request, error.message)
    else:
        messages.success(request, done)
    return redirect("dashboard:members")


@require_POST
@dashboard_view(Role.OWNER)
def member_add_view(request: DashboardRequest) -> HttpResponse:
    who, role = request.POST.get("user", ""), request.POST.get("role", "")
    return _member_action(request, lambda: services.membership_add(
        tenant=request.dashboard.tenant, user_identifier=who, role=role), f"Added {who.strip()} as {role}.")


@require_POST
@dashboard_view(Role.OWNER)
def member_role_view(request: DashboardRequest, membership_id: int) -> HttpResponse:
    membership, role = _member(request, membership_id), request.POST.get("role", "")
    return _member_action(request, lambda: services.membership_set_role(membership=membership, role=role),
                          f"{membership.user.get_username()} is now {role}.")


def _removed(name: str, revoked: list[ApiKey]) -> str:
    if not revoked:
        return f"Removed {name}."
    if len(revoked) == 1:
        return f"Removed {name}; the API key {name} created is revoked."
    return f"Removed {name}; the {len(revoked)} API keys {name} created are revoked."


@require_POST
@dashboard_view(Role.OWNER)
def member_remove_view(request: DashboardRequest, membership_id: int) -> HttpResponse:
    """Removing a member also revokes the keys they created here (the confirmation says so)."""
    membership = _member(request, membership_id)
    name = membership.user.get_username()
    try:
        revoked = services.membership_remove(membership=membership)
    except ServiceError as error:
        messages.error(request, error.message)
    else:
        messages.success(request, _removed(name, revoked))
    return redirect("dashboard:members")
