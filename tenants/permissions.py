"""Who may call the management API: a tenant's caller, with write rights for unsafe methods."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.request import Request

from tenants.authentication import TenantAuth
from tenants.models import ApiKey

if TYPE_CHECKING:  # rest_framework.views imports this module through its settings: no cycle at run time
    from rest_framework.views import APIView


class HasTenant(BasePermission):
    """The request is authenticated for a tenant; keys need the `manage` scope for this API.

    Reads are open to every member and to keys with the `manage` scope; writes need the `manage`
    scope or an owner/member role (viewers read only).
    """

    message = "Authentication credentials were not provided."

    def has_permission(self, request: Request, view: "APIView") -> bool:
        auth = request.auth
        if not isinstance(auth, TenantAuth):
            return False
        if auth.api_key is not None and not auth.has_scope(ApiKey.Scope.MANAGE):
            self.message = "This API key lacks the 'manage' scope needed for the management API."
            return False
        if request.method not in SAFE_METHODS and not auth.can_write():
            self.message = "Your role in this tenant is read-only."
            return False
        return True
