"""The tenant's people and access: its API keys (create, list, revoke) and its members (add, role, remove)."""

from __future__ import annotations

from collections.abc import Callable

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from dashboard.tenancy import DashboardRequest, Role, dashboard_view
from serving.wire.errors import ServiceError
from tenants import selectors, services
from tenants.models import ApiKey, Membership
from tenants.permissions import KEY_MANAGER_ROLE


def _keys_page(request: DashboardRequest, *, created: tuple[ApiKey, str] | None = None,
               error: ServiceError | None = None, status: int = 200) -> HttpResponse:
    tenant = request.dashboard.tenant
    return render(request, "dashboard/keys.html", {
        "keys": selectors.api_key_list(tenant=tenant), "scopes": ApiKey.Scope.choices,
        "created": created[0] if created else None, "created_secret": created[1] if created else None,
        "error": error, "nav": "keys",
    }, status=status)


@dashboard_view(Role.VIEWER)
def api_key_list_view(request: DashboardRequest) -> HttpResponse:
    return _keys_page(request)


@require_POST
@dashboard_view(KEY_MANAGER_ROLE)
def api_key_create_view(request: DashboardRequest) -> HttpResponse:
    """Answers with the page itself, not a redirect: the full key is in this response and nowhere else."""
    try:
        created = services.api_key_create(tenant=request.dashboard.tenant, name=request.POST.get("name", ""),
                                          scopes=request.POST.getlist("scopes"), created_by=request.user)
    except ServiceError as error:
        return _keys_page(request, error=error, status=400)
    return _keys_page(request, created=created)


@require_POST
@dashboard_view(KEY_MANAGER_ROLE)
def api_key_revoke_view(request: DashboardRequest, key_id: int) -> HttpResponse:
    key = selectors.api_key_list(tenant=request.dashboard.tenant).filter(pk=key_id).first()
    if key is None:
        raise Http404(f"No API key {key_id}.")
    services.api_key_revoke(api_key=key)
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
