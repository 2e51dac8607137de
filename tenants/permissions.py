"""Who may call the management API: a tenant's caller, with write rights for unsafe methods; and
the one rule for the tenant's API keys, which every surface (this API, the dashboard) applies."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.request import Request

from tenants.authentication import TenantAuth
from tenants.models import ApiKey, Membership

if TYPE_CHECKING:  # rest_framework.views imports this module through its settings: no cycle at run time
    from rest_framework.views import APIView

# Creating and revoking a tenant's keys is an owner's act everywhere: a key outlives the session that
# made it, so whoever may mint one may hand the tenant's access (and quota) to anyone. The dashboard's
# key views require this role too; reading the list (names, prefixes, never secrets) is every member's.
KEY_MANAGER_ROLE = Membership.Role.OWNER
INSUFFICIENT_SCOPE = "insufficient_scope"


def api_key_management_refusal(auth: TenantAuth) -> str | None:
    """Why this caller may not create or revoke the tenant's API keys; None when they may.

    A session needs the owner role. A key needs the `manage` scope: only an owner (or the platform
    operator) can have made such a key, and the keys it makes are recorded as that owner's.
    """
    if auth.api_key is not None:
        if auth.api_key.has_scope(ApiKey.Scope.MANAGE):
            return None
        return "This API key lacks the 'manage' scope needed to create or revoke API keys."
    if auth.role == KEY_MANAGER_ROLE:
        return None
    return (f"Creating and revoking API keys needs the {KEY_MANAGER_ROLE} role; yours in '{auth.tenant.slug}' "
            f"is {auth.role}.")


class HasTenant(BasePermission):
    """The request is authenticated for a tenant; keys need the `manage` scope for this API.

    Reads are open to every member and to keys with the `manage` scope; writes need the `manage`
    scope or an owner/member role (viewers read only).
    """

    message = "Authentication credentials were not provided."
    # DRF's refusal code (PermissionDenied's): `insufficient_scope` for a key without the scope, as
    # the gateway's /v1 routes answer it, so a client tells "wrong key" from "wrong role" alike on both.
    code: str | None = None

    def has_permission(self, request: Request, view: "APIView") -> bool:
        auth = request.auth
        if not isinstance(auth, TenantAuth):
            return False
        if auth.api_key is not None and not auth.has_scope(ApiKey.Scope.MANAGE):
            self.message = "This API key lacks the 'manage' scope needed for the management API."
            self.code = INSUFFICIENT_SCOPE
            return False
        if request.method not in SAFE_METHODS and not auth.can_write():
            self.message = "Your role in this tenant is read-only."
            return False
        return True


class CanManageApiKeys(HasTenant):
    """HasTenant, and for writes (create, revoke) the API-key rule above."""

    def has_permission(self, request: Request, view: "APIView") -> bool:
        if not super().has_permission(request, view):
            return False
        if request.method in SAFE_METHODS:
            return True
        assert isinstance(request.auth, TenantAuth)  # HasTenant checked it
        refusal = api_key_management_refusal(request.auth)
        if refusal is not None:
            self.message = refusal
            if request.auth.api_key is not None:  # a key's refusal is its scope's; a session's, its role's
                self.code = INSUFFICIENT_SCOPE
            return False
        return True
