"""DRF authentication: `Authorization: Bearer lp-…` API keys, or a dashboard session.

Either way the request ends up with `request.auth` set to a `TenantAuth`, which names the tenant
every query of the request is scoped to (see tenants.scoping).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.contrib.auth.models import AnonymousUser, User
from django.utils import timezone
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, SessionAuthentication
from rest_framework.request import Request

from tenants.api_keys import parse_key, secret_matches
from tenants.models import ApiKey, Membership, Tenant

# Writing last_used_at on every request would turn each read into a write; a minute is precise
# enough for "is this key still in use?".
LAST_USED_PRECISION = timedelta(minutes=1)
SESSION_TENANT_KEY = "tenant_id"
# The error code of an expired key, on the management API and the gateway alike.
KEY_EXPIRED = "key_expired"


@dataclass(frozen=True)
class TenantAuth:
    """Who is calling, on behalf of which tenant."""

    tenant: Tenant
    api_key: ApiKey | None = None
    role: str | None = None  # the membership role of a session user
    user: User | None = None  # the session's user

    @property
    def key_creator(self) -> User | None:
        """Whom a key this caller creates is recorded as created by (and revoked with): the
        session's user, or the creator of the calling key (None for the operator's keys)."""
        return self.api_key.created_by if self.api_key is not None else self.user

    @property
    def actor(self) -> str:
        """How the audit log names this caller."""
        if self.api_key is not None:
            return f"api-key:{self.api_key.prefix}"
        if self.user is not None:
            return f"user:{self.user.get_username()}"
        return "session"

    def has_scope(self, scope: str) -> bool:
        if self.api_key is not None:
            return self.api_key.has_scope(scope)
        return True

    def can_write(self) -> bool:
        if self.api_key is not None:
            return self.api_key.has_scope(ApiKey.Scope.MANAGE)
        return self.role in (Membership.Role.OWNER, Membership.Role.MEMBER)


def _refuse_suspended(tenant: Tenant) -> None:
    if not tenant.is_active:
        raise exceptions.PermissionDenied(
            f"Tenant '{tenant.slug}' is suspended; its API keys and sessions are refused. "
            "Contact the platform operator."
        )


def api_key_authenticate(raw_header: str) -> TenantAuth:
    """The TenantAuth for an `Authorization` header value; raises 401/403 API errors otherwise.

    Shared by the DRF authentication class and the inference gateway.
    """
    scheme, _, token = raw_header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token:
        raise exceptions.AuthenticationFailed(
            "Malformed Authorization header: expected 'Authorization: Bearer lp-<prefix>.<secret>'."
        )
    parsed = parse_key(token)
    if parsed is None:
        raise exceptions.AuthenticationFailed(
            "Malformed API key: Loraplex keys look like 'lp-<prefix>.<secret>'."
        )
    key = ApiKey.objects.select_related("tenant", "tenant__tier").filter(prefix=parsed.prefix).first()
    if key is None or not secret_matches(parsed.secret, key.secret_hash):
        raise exceptions.AuthenticationFailed("Incorrect API key provided.")
    if key.is_revoked:
        raise exceptions.AuthenticationFailed("This API key has been revoked.")
    now = timezone.now()
    if key.is_expired(now):
        assert key.expires_at is not None
        raise exceptions.AuthenticationFailed(
            f"This API key (lp-{key.prefix}…) expired at {key.expires_at.isoformat(timespec='seconds')}; a tenant "
            "owner can extend it or create a new key.", code=KEY_EXPIRED)
    _refuse_suspended(key.tenant)
    if key.last_used_at is None or now - key.last_used_at > LAST_USED_PRECISION:
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
        key.last_used_at = now
    return TenantAuth(tenant=key.tenant, api_key=key)


class ApiKeyAuthentication(BaseAuthentication):
    def authenticate(self, request: Request) -> tuple[AnonymousUser, TenantAuth] | None:
        header = request.META.get("HTTP_AUTHORIZATION")
        if header is None:
            return None
        if "," in header:
            # Django joins repeated headers with a comma, and no key holds one: two credentials are
            # ambiguous, so neither is tried (the gateway's /v1 routes answer the same).
            raise exceptions.ParseError(
                "Send one Authorization header: two were sent. Expected 'Authorization: Bearer lp-<prefix>.<secret>'.",
                code="duplicate_authorization")
        return AnonymousUser(), api_key_authenticate(header)

    def authenticate_header(self, request: Request) -> str:
        # Makes DRF answer 401 (with WWW-Authenticate) rather than 403 when no credentials came.
        return 'Bearer realm="loraplex"'


class TenantSessionAuthentication(SessionAuthentication):
    """A logged-in dashboard user acts for the tenant chosen in the session (or their only one)."""

    def authenticate(self, request: Request) -> tuple[object, TenantAuth] | None:
        result = super().authenticate(request)
        if result is None:
            return None
        user = result[0]
        memberships = Membership.objects.select_related("tenant", "tenant__tier", "user").filter(user=user)
        chosen = request._request.session.get(SESSION_TENANT_KEY)
        membership = (memberships.filter(tenant_id=chosen).first() if chosen else None) or memberships.first()
        if membership is None:
            raise exceptions.PermissionDenied("This user is not a member of any tenant.")
        _refuse_suspended(membership.tenant)
        return user, TenantAuth(tenant=membership.tenant, role=membership.role, user=membership.user)
