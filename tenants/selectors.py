"""Queries about tenants (reads only; changes live in services.py)."""

from __future__ import annotations

from django.db.models import Count, Q, QuerySet

from lora_platform.errors import NotFound
from tenants.models import Tenant


def tenant_list() -> QuerySet[Tenant]:
    """Every tenant with its tier, annotated with `active_key_count` (keys not revoked)."""
    return Tenant.objects.select_related("tier").annotate(
        active_key_count=Count("api_keys", filter=Q(api_keys__revoked_at__isnull=True))
    ).order_by("slug")


def tenant_by_slug(slug: str) -> Tenant:
    tenant = Tenant.objects.select_related("tier").filter(slug=slug).first()
    if tenant is None:
        raise NotFound(f"No tenant with slug '{slug}'.", param="slug")
    return tenant
