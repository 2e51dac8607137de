"""Queries about tenants (reads only; changes live in services.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

from django.contrib.auth.base_user import AbstractBaseUser
from django.contrib.auth.models import AnonymousUser, User
from django.db.models import Count, Q, QuerySet

from serving.contracts.errors import NotFound
from tenants.api_keys import KEY_PREFIX, parse_key
from tenants.models import ApiKey, Membership, Tenant, TenantEvent

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


def api_key_by_prefix(text: str) -> ApiKey:
    """The key a public prefix names (`lp-3f9a…`, `3f9a…` or the full key: the prefix is read from
    it); NotFound otherwise. For the operator's CLI, which works across tenants."""
    prefix = text.strip().removeprefix(KEY_PREFIX).partition(".")[0].rstrip("…").rstrip(".")
    key = ApiKey.objects.select_related("tenant__tier").filter(prefix=prefix).first() if prefix else None
    if key is None:
        raise NotFound(f"No API key with the prefix '{prefix or text}'; `manage.py tenants keys <slug>` lists a "
                       "tenant's keys.", code="key_not_found", param="key")
    return key


def api_keys_above_tier(*, tenant: Tenant) -> list[ApiKey]:
    """The tenant's live keys whose own rpm or tpm is above its tier's (after a move to a lower
    tier): the tier's bucket is the tighter one for them."""
    tier = tenant.tier
    return list(ApiKey.objects.filter(tenant=tenant, revoked_at__isnull=True).filter(
        Q(requests_per_minute__gt=tier.requests_per_minute) | Q(tokens_per_minute__gt=tier.tokens_per_minute)))


def tenant_events(*, tenant: Tenant) -> QuerySet[TenantEvent]:
    """The tenant's access audit log (keys, tier), newest first."""
    return TenantEvent.objects.filter(tenant=tenant).order_by("-id")


def api_key_is_live(*, tenant: Tenant, full_key: str) -> bool:
    """Whether `full_key` is one of the tenant's keys and not revoked (the playground's key, kept in a session)."""
    parsed = parse_key(full_key)
    return parsed is not None and ApiKey.objects.filter(tenant=tenant, prefix=parsed.prefix,
                                                        revoked_at__isnull=True).exists()


def api_key_live(*, tenant_id: int, full_key: str, created_by: User) -> ApiKey | None:
    """The tenant's live key `full_key` if `created_by` made it (a playground key kept in their session)."""
    parsed = parse_key(full_key)
    return None if parsed is None else ApiKey.objects.filter(
        tenant_id=tenant_id, prefix=parsed.prefix, created_by=created_by, revoked_at__isnull=True).first()


def membership_list(*, tenant: Tenant) -> QuerySet[Membership]:
    return Membership.objects.filter(tenant=tenant).select_related("user").order_by("role", "user__username")
