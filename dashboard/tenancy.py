"""The dashboard's request plumbing: which tenant a logged-in user acts for, and with what role.

Every dashboard view is wrapped by `dashboard_view(role)`: it requires a login, picks the tenant
the session chose (the switcher writes the same session key the session-authenticated API reads,
so both act for one tenant) or the user's first, refuses suspended tenants, and refuses a role
below the one the view needs (viewers read, members act, owners also manage keys). Views then
reach rows only through `request.dashboard.tenant`, so another tenant's object is a 404.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import wraps
from typing import Any, cast

from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest
from django.http.response import HttpResponseBase

from serving.contracts.errors import NotFound
from tenants.authentication import SESSION_TENANT_KEY, TenantAuth
from tenants.models import Membership, Tenant
from tenants.selectors import memberships_of

Role = Membership.Role
_RANK: dict[str, int] = {Role.VIEWER: 0, Role.MEMBER: 1, Role.OWNER: 2}


@dataclass(frozen=True)
class TenantContext:
    """The tenant a dashboard request acts for, the user's role in it, and their other tenants."""

    tenant: Tenant
    role: str
    memberships: list[Membership] = field(default_factory=list)

    def can(self, role: str) -> bool:
        return _RANK[self.role] >= _RANK[role]

    @property
    def can_act(self) -> bool:
        return self.can(Role.MEMBER)

    @property
    def can_manage(self) -> bool:
        return self.can(Role.OWNER)

    @property
    def auth(self) -> TenantAuth:
        """The same TenantAuth the session-authenticated API would build for this request."""
        return TenantAuth(tenant=self.tenant, role=self.role)


class DashboardRequest(HttpRequest):
    """The request a `dashboard_view` hands its view: an HttpRequest that carries its TenantContext,
    for a logged-in user."""

    dashboard: TenantContext
    user: User


def tenant_context(request: HttpRequest) -> TenantContext | None:
    """The session's chosen tenant when the user is still its member, else their first; None if none."""
    memberships = memberships_of(request.user)
    if not memberships:
        return None
    chosen = request.session.get(SESSION_TENANT_KEY)
    membership = next((item for item in memberships if item.tenant_id == chosen), memberships[0])
    return TenantContext(tenant=membership.tenant, role=membership.role, memberships=memberships)


def tenant_switch(request: HttpRequest, *, slug: str) -> TenantContext:
    """Makes the session act for the user's tenant `slug`; a tenant they are not in is a 404."""
    membership = next((item for item in memberships_of(request.user) if item.tenant.slug == slug), None)
    if membership is None:
        raise Http404(f"You are not a member of a tenant '{slug}'.")
    request.session[SESSION_TENANT_KEY] = membership.tenant_id
    return TenantContext(tenant=membership.tenant, role=membership.role)


def dashboard_actor(request: HttpRequest) -> str:
    """How the audit log names a dashboard user: as the session-authenticated API does."""
    return f"user:{request.user.get_username()}"


def dashboard_view(
        role: str = Role.VIEWER) -> Callable[[Callable[..., HttpResponseBase]], Callable[..., HttpResponseBase]]:
    """Login, tenant and role checks for a dashboard view; the view finds `request.dashboard`.

    A view may answer with any response, a streamed file (the guides' screenshots) included."""

    def decorate(view: Callable[..., HttpResponseBase]) -> Callable[..., HttpResponseBase]:
        @login_required
        @wraps(view)
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            context = tenant_context(request)
            if context is None:
                raise PermissionDenied("Your account is not a member of any tenant; ask a tenant owner to add you.")
            if not context.tenant.is_active:
                raise PermissionDenied(f"Tenant '{context.tenant.slug}' is suspended; contact the platform operator.")
            if not context.can(role):
                raise PermissionDenied(f"This needs the {role} role; yours in '{context.tenant.slug}' is "
                                       f"{context.role}.")
            # From here on the request carries its context: it is the DashboardRequest the view expects.
            dashboard_request = cast(DashboardRequest, request)
            dashboard_request.dashboard = context
            try:
                return view(dashboard_request, *args, **kwargs)
            except NotFound as error:
                raise Http404(error.message) from None

        return wrapped

    return decorate
