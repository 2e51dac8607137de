"""Queries about tenants (reads only; changes live in services.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

from django.contrib.auth.base_user import AbstractBaseUser
from django.contrib.auth.models import AnonymousUser
from django.db.models import Count, Q, QuerySet

from serving.wire.errors import NotFound
from tenants.api_keys import parse_key
from tenants.models import ApiKey, Membership, Tenant

if TYPE_CHECKING:  # django-stubs-ext is a dev dependency; only the annotations name it
    from django_stubs_ext import WithAnnotations


class _KeyCount(TypedDict):
    active_key_count: int


def tenant_list() -> QuerySet[WithAnnotations[Tenant, _KeyCount]]:
    """Every tenant with its tier, annotated with `active_key_count` (keys not revoked)."""
    return Tenant.objects.select_related("tier").annotate(
        active_key_count=Count("api_keys", filter=Q(api_keys__revoked_at__isnull=True))
    ).order_by("slug")


def tenant_by_slug(slug: str) -> Tenant:
    tenant = Tenant.objects.select_related("tier").filter(slug=slug).first()
    if tenant is None:
        raise NotFound(f"No tenant with slug '{slug}'.", param="slug")
    return tenant


def memberships_of(user: AbstractBaseUser | AnonymousUser) -> list[Membership]:
    """The user's memberships with their tenants and tiers, by tenant slug (the dashboard's switcher)."""
    if user.pk is None:  # the anonymous user
        return []
    return list(Membership.objects.filter(user_id=user.pk).select_related("tenant__tier").order_by("tenant__slug"))


def api_key_list(*, tenant: Tenant) -> QuerySet[ApiKey]:
    """The tenant's keys, newest first, revoked ones included (they say when they were revoked)."""
    return ApiKey.objects.filter(tenant=tenant).select_related("created_by").order_by("-created_at", "-id")


def api_key_is_live(*, tenant: Tenant, full_key: str) -> bool:
    """Whether `full_key` is one of the tenant's keys and not revoked (the playground's key, kept in a session)."""
    parsed = parse_key(full_key)
    return parsed is not None and ApiKey.objects.filter(tenant=tenant, prefix=parsed.prefix,
                                                        revoked_at__isnull=True).exists()


def membership_list(*, tenant: Tenant) -> QuerySet[Membership]:
    return Membership.objects.filter(tenant=tenant).select_related("user").order_by("role", "user__username")
