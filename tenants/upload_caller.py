"""The tenant an upload is sent for, read from the request's raw credentials before any view runs.

An upload's limit is its tenant's tier's (datasets, TRAINING_DATASET_MAX_BYTES_BY_TIER), and it is
needed before the body is read, by the ASGI body limit (lora_platform.body_limit), which has only
the headers: no view has authenticated the caller yet. The rules are the API's own: an API key that may write
(the `manage` scope, of an active tenant; checked by api_key_authenticate), or a session user who
is an owner or member of the tenant the session chose (else their first, as
TenantSessionAuthentication picks), active. Anything else is no tenant: the small, anonymous limit.
This decides only how many bytes are read; the view still authenticates and authorises as always.
"""

from __future__ import annotations

from importlib import import_module

from django.conf import settings
from django.contrib.auth import get_user
from django.http import HttpRequest
from rest_framework.exceptions import APIException

from tenants.authentication import SESSION_TENANT_KEY, api_key_authenticate
from tenants.models import Membership, Tenant

_WRITERS = (Membership.Role.OWNER, Membership.Role.MEMBER)


def upload_tenant(authorization: list[str], session_key: str | None) -> Tenant | None:
    """The tenant whose credentials these are, when they may upload; None otherwise.

    `authorization`: every Authorization header sent (two are ambiguous, so no credentials at all);
    `session_key`: the session cookie's value, tried only when no Authorization header came.
    """
    if len(authorization) == 1:
        try:
            auth = api_key_authenticate(authorization[0])
        except APIException:
            return None
        return auth.tenant if auth.can_write() else None
    if authorization or session_key is None:
        return None
    request = HttpRequest()
    request.session = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    user = get_user(request)  # checks the session's auth hash, as the session middleware does
    if not (user.is_authenticated and user.is_active):
        return None
    memberships = Membership.objects.select_related("tenant", "tenant__tier").filter(user=user)
    chosen = request.session.get(SESSION_TENANT_KEY)
    membership = (memberships.filter(tenant_id=chosen).first() if chosen else None) or memberships.first()
    if membership is None or membership.role not in _WRITERS or not membership.tenant.is_active:
        return None
    return membership.tenant

