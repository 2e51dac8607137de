"""Tenant scoping by construction: the one way API views reach tenant-owned rows.

Every tenant-owned model uses `TenantScopedQuerySet` (directly, or through a lookup path such as
`adapter__tenant`), and every API view derives from `TenantScopedViewSet` / `TenantScopedAPIView`,
whose `get_queryset` always filters by the caller's tenant. A subclass narrows the queryset in
`scope_queryset`, which only ever sees the already-filtered rows, so no view can forget the
tenant filter. Another tenant's object therefore simply does not exist: 404, never 403.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import models
from rest_framework import generics, viewsets
from rest_framework.request import Request

from tenants.authentication import TenantAuth
from tenants.models import Tenant


class TenantScopedQuerySet(models.QuerySet):
    """A queryset that knows the path from its model to the owning tenant."""

    tenant_path: ClassVar[str] = "tenant"

    def for_tenant(self, tenant: Tenant) -> "TenantScopedQuerySet":
        path = getattr(self.model, "TENANT_PATH", self.tenant_path)
        return self.filter(**{path: tenant})


def request_auth(request: Request) -> TenantAuth:
    """The TenantAuth our authentication classes set (DRF types `request.auth` as a token)."""
    auth = request.auth
    if not isinstance(auth, TenantAuth):
        raise PermissionError("request_auth() called on a request without tenant authentication")
    return auth


def request_tenant(request: Request) -> Tenant:
    return request_auth(request).tenant


class _TenantScoped(generics.GenericAPIView):
    """The scoping logic shared by viewsets and plain generic views."""

    def get_queryset(self) -> models.QuerySet:
        unscoped = super().get_queryset()  # the class's `queryset`, fresh for this request
        path = getattr(unscoped.model, "TENANT_PATH", "tenant")
        scoped = unscoped.filter(**{path: request_tenant(self.request)})
        return self.scope_queryset(scoped)

    def scope_queryset(self, queryset: models.QuerySet) -> models.QuerySet:
        """Narrow (never widen) the tenant's rows for this view; the default keeps them all."""
        return queryset

    @property
    def tenant(self) -> Tenant:
        return request_tenant(self.request)

    @property
    def tenant_auth(self) -> TenantAuth:
        return request_auth(self.request)


class TenantScopedViewSet(_TenantScoped, viewsets.GenericViewSet):
    pass


class TenantScopedAPIView(_TenantScoped, generics.GenericAPIView):
    pass
