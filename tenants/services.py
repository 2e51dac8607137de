"""Everything that changes tenants, memberships and API keys."""

from __future__ import annotations

import getpass
import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from django.core.validators import validate_email
from django.db import IntegrityError, transaction
from django.db.models import CharField, Model
from django.utils import timezone
from django.utils.text import slugify

from serving.contracts.errors import Conflict, InvalidInput, NotFound
from tenants.api_keys import generate_key, hash_secret
from tenants.key_controls import controls_clean
from tenants.models import ApiKey, Membership, Tenant, TenantEvent, Tier
from tenants.selectors import tenant_by_slug
from tenants.tiers import DEFAULT_TIERS

log = logging.getLogger(__name__)

DEFAULT_SCOPES = [ApiKey.Scope.INFERENCE.value, ApiKey.Scope.MANAGE.value]
# The audit actor of changes made without one: the platform's own (a tenant's first key).
OPERATOR_ACTOR = "operator"


def _max_length(model: type[Model], name: str) -> int:
    """The max_length of a model's CharField (a CharField always has one)."""
    field = model._meta.get_field(name)
    if not isinstance(field, CharField) or field.max_length is None:
        raise TypeError(f"{model.__name__}.{name} is not a CharField with a max_length")
    return field.max_length


SLUG_MAX_LENGTH = _max_length(Tenant, "slug")
NAME_MAX_LENGTH = _max_length(Tenant, "name")
KEY_NAME_MAX_LENGTH = _max_length(ApiKey, "name")


def tiers_seed() -> list[Tier]:
    """Create or restore the default tiers (the seed migration's data), idempotently.

    A database flushed after migrating (as transactional tests do) loses the migration's rows; this
    puts them back.
    """
    return [Tier.objects.update_or_create(name=values["name"], defaults=values)[0] for values in DEFAULT_TIERS]


def _tier_by_name(name: str) -> Tier:
    tier = Tier.objects.filter(name=name).first()
    if tier is None:
        known = ", ".join(Tier.objects.values_list("name", flat=True)) or "none"
        raise InvalidInput(f"Unknown tier '{name}'. Known tiers: {known}.", code="unknown_tier", param="tier")
    return tier


def operator_actor() -> str:
    """How the audit logs name the operator at a shell (`manage.py tenants`, `manage.py registry`):
    `operator:<login name>`."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name in the environment nor the password database
        user = "unknown"
    return f"operator:{user}"


def _key_subject(key: ApiKey) -> str:
    return f"lp-{key.prefix}… ({key.name})"[:200]


def _audit_value(value: Any) -> Any:
    """A control's value as the audit log's JSON keeps it."""
    return value.isoformat() if isinstance(value, datetime) else value


def _audit(*, tenant: Tenant, kind: str, subject: str, actor: str, reason: str = "",
           changes: dict[str, tuple[Any, Any]] | None = None) -> TenantEvent:
    if not actor.strip():
        raise InvalidInput("A change to a tenant's access needs an actor for the audit log.", param="actor")
    return TenantEvent.objects.create(
        tenant=tenant, kind=kind, subject=subject, actor=actor.strip()[:200], reason=reason.strip(),
        changes={name: [_audit_value(old), _audit_value(new)] for name, (old, new) in (changes or {}).items()},
    )


def api_key_create(*, tenant: Tenant, name: str, scopes: list[str] | None = None,
                   created_by: User | None = None, controls: Mapping[str, Any] | None = None,
                   actor: str = OPERATOR_ACTOR, reason: str = "") -> tuple[ApiKey, str]:
    """A new key for the tenant: (the row, the full key, which is never retrievable again).

    `created_by` is the member it belongs to (revoked when they leave the tenant); None for the
    operator's keys. `controls` are its own limits (tenants.key_controls). Who may create keys is
    the callers' business (tenants.permissions). The creation is audited (TenantEvent).
    """
    scopes = list(DEFAULT_SCOPES if scopes is None else scopes)
    unknown = sorted(set(scopes) - set(ApiKey.Scope.values))
    if unknown:
        raise InvalidInput(
            f"Unknown scope(s) {', '.join(unknown)}; valid scopes are {', '.join(ApiKey.Scope.values)}.",
            code="unknown_scope", param="scopes",
        )
    if not scopes:
        raise InvalidInput("An API key needs at least one scope.", code="empty_scopes", param="scopes")
    if not name.strip() or len(name.strip()) > KEY_NAME_MAX_LENGTH:
        raise InvalidInput(f"An API key needs a name of 1 to {KEY_NAME_MAX_LENGTH} characters.", param="name")
    cleaned = controls_clean(controls or {}, tier=tenant.tier)
    full_key, parts = generate_key()
    with transaction.atomic():
        key = ApiKey.objects.create(
            tenant=tenant, name=name.strip(), prefix=parts.prefix, secret_hash=hash_secret(parts.secret),
            scopes=sorted(set(scopes)), created_by=created_by, **cleaned,
        )
        _audit(tenant=tenant, kind=TenantEvent.Kind.KEY_CREATE, subject=_key_subject(key), actor=actor,
               reason=reason, changes={field: (None, value) for field, value in cleaned.items()
                                       if value not in (None, [])})
    return key, full_key


def api_key_update(*, api_key: ApiKey, controls: Mapping[str, Any], actor: str, reason: str = "") -> ApiKey:
    """Changes the key's own controls (any of tenants.key_controls.CONTROL_FIELDS; None clears one)
    and audits what changed. A revoked key is refused: it has nothing left to limit."""
    with transaction.atomic():
        key = ApiKey.objects.select_for_update().select_related("tenant__tier").filter(pk=api_key.pk).first()
        if key is None:
            raise NotFound(f"No API key lp-{api_key.prefix}….", code="key_not_found")
        if key.is_revoked:
            raise Conflict(f"API key {_key_subject(key)} is revoked; create a new key instead.", code="key_revoked")
        cleaned = controls_clean(controls, tier=key.tenant.tier)
        changes = {field: (getattr(key, field), value) for field, value in cleaned.items()
                   if getattr(key, field) != value}
        if changes:
            for field, (_, value) in changes.items():
                setattr(key, field, value)
            key.save(update_fields=list(changes))
            _audit(tenant=key.tenant, kind=TenantEvent.Kind.KEY_UPDATE, subject=_key_subject(key), actor=actor,
                   reason=reason, changes=changes)
    return key


def api_key_revoke(*, api_key: ApiKey, actor: str = OPERATOR_ACTOR, reason: str = "") -> ApiKey:
    """Revoking is idempotent: the first revocation time is kept, and audited once."""
    with transaction.atomic():
        key = ApiKey.objects.select_for_update().select_related("tenant").filter(pk=api_key.pk).first()
        if key is None:
            raise NotFound(f"No API key lp-{api_key.prefix}….", code="key_not_found")
        if key.revoked_at is None:
            key.revoked_at = timezone.now()
            key.save(update_fields=["revoked_at"])
            _audit(tenant=key.tenant, kind=TenantEvent.Kind.KEY_REVOKE, subject=_key_subject(key), actor=actor,
                   reason=reason)
    api_key.revoked_at = key.revoked_at
    return api_key


@transaction.atomic
def tenant_create(*, slug: str, tier_name: str, name: str | None = None,
                  owner_email: str | None = None) -> tuple[Tenant, str]:
    """A new tenant with its first API key (returned once), and its owner when an email is given."""
    if slug != slugify(slug) or not slug or "_" in slug:
        raise InvalidInput(
            f"Invalid tenant slug '{slug}': use lowercase letters, digits and hyphens.", param="slug"
        )
    if len(slug) > SLUG_MAX_LENGTH:
        raise InvalidInput(f"Tenant slug '{slug}' is longer than {SLUG_MAX_LENGTH} characters.", param="slug")
    if name is not None and not (0 < len(name.strip()) <= NAME_MAX_LENGTH):
        raise InvalidInput(f"A tenant name must have 1 to {NAME_MAX_LENGTH} characters.", param="name")
    if owner_email:
        try:
            validate_email(owner_email)
        except ValidationError:
            raise InvalidInput(f"'{owner_email}' is not an email address.", param="owner_email") from None
    tier = _tier_by_name(tier_name)
    try:
        with transaction.atomic():
            tenant = Tenant.objects.create(slug=slug, name=(name or slug).strip(), tier=tier)
    except IntegrityError:
        raise Conflict(f"A tenant with slug '{slug}' already exists.", code="duplicate_slug", param="slug")
    if owner_email:
        user_model = get_user_model()
        user = user_model.objects.filter(email__iexact=owner_email).first()
        if user is None:
            user = user_model.objects.create_user(username=owner_email, email=owner_email)
        Membership.objects.create(user=user, tenant=tenant, role=Membership.Role.OWNER)
    _, full_key = api_key_create(tenant=tenant, name="default")
    return tenant, full_key


@transaction.atomic
def tenant_set_tier(*, slug: str, tier_name: str, actor: str, reason: str = "") -> Tenant:
    """Moves the tenant to another tier (its quotas and priority), audited. Keys whose own rpm or
    tpm is above the new tier's keep them, but the tier's bucket is the tighter one then
    (tenants.selectors.api_keys_above_tier lists them)."""
    tenant = Tenant.objects.select_for_update().select_related("tier").filter(slug=slug).first()
    if tenant is None:
        raise NotFound(f"No tenant with slug '{slug}'.", param="slug")
    tier = _tier_by_name(tier_name)
    previous = tenant.tier
    if previous.pk == tier.pk:
        raise Conflict(f"Tenant '{slug}' is already on the '{tier.name}' tier.", code="tier_unchanged", param="tier")
    tenant.tier = tier
    tenant.save(update_fields=["tier"])
    _audit(tenant=tenant, kind=TenantEvent.Kind.TIER_CHANGE, subject=tier.name, actor=actor, reason=reason,
           changes={"tier": (previous.name, tier.name)})
    return tenant


def tenant_set_status(*, slug: str, status: str) -> Tenant:
    tenant = tenant_by_slug(slug)
    if status not in Tenant.Status.values:
        raise InvalidInput(f"Unknown status '{status}'.", param="status")
    tenant.status = status
    tenant.save(update_fields=["status"])
    return tenant


def tenant_suspend(*, slug: str) -> Tenant:
    """Refuses the tenant's keys and sessions (403) until it is activated again; nothing is deleted."""
    return tenant_set_status(slug=slug, status=Tenant.Status.SUSPENDED)


def tenant_activate(*, slug: str) -> Tenant:
    return tenant_set_status(slug=slug, status=Tenant.Status.ACTIVE)


def playground_key_issue(*, tenant: Tenant, user: User) -> tuple[ApiKey, str]:
    """A fresh inference-only key with which the dashboard's playground calls `/v1` for a user.

    Its secret lives only in that user's session (the playground page hands it to the browser);
    a new one revokes the user's earlier playground keys in the tenant, so at most one is live.
    The usage page lists its requests under its name like any key's.
    """
    name = f"playground: {user.get_username()}"[:KEY_NAME_MAX_LENGTH]
    with transaction.atomic():
        # By creator too: an owner's key that happens to bear this name is not the playground's.
        actor = f"user:{user.get_username()}"
        for earlier in ApiKey.objects.filter(tenant=tenant, name=name, created_by=user, revoked_at__isnull=True):
            api_key_revoke(api_key=earlier, actor=actor, reason="replaced by a new playground key")
        return api_key_create(tenant=tenant, name=name, scopes=[ApiKey.Scope.INFERENCE.value], created_by=user,
                              actor=actor)


def api_keys_revoke_created_by(*, tenant: Tenant, user: User, deactivated: bool = False) -> list[ApiKey]:
    """Revokes the live keys `user` created in `tenant` (they leave it, or their account is
    deactivated); the keys revoked, each audited with the actor `member-left:<username>` or
    `user-deactivated:<username>` (the removal or deactivation revokes them, whoever did it and by
    whichever path: tenants.receivers)."""
    actor, reason, told = (("user-deactivated", "its creator's account was deactivated", "was deactivated")
                           if deactivated else ("member-left", "its creator left the tenant", "left the tenant"))
    now = timezone.now()
    with transaction.atomic():
        keys = list(ApiKey.objects.select_for_update().filter(tenant=tenant, created_by_id=user.pk,
                                                              revoked_at__isnull=True))
        ApiKey.objects.filter(pk__in=[key.pk for key in keys]).update(revoked_at=now)
        for key in keys:
            key.revoked_at = now
            _audit(tenant=tenant, kind=TenantEvent.Kind.KEY_REVOKE, subject=_key_subject(key),
                   actor=f"{actor}:{user.get_username()}", reason=reason)
    for key in keys:
        log.info("API key lp-%s… (%s) of tenant %s revoked: its creator %s %s", key.prefix, key.name,
                 tenant.slug, user.get_username(), told)
    return keys


def _owners_after(membership: Membership, role: str | None) -> int:
    """How many owners the tenant keeps if `membership` takes `role` (None: leaves)."""
    others = Membership.objects.filter(tenant=membership.tenant, role=Membership.Role.OWNER).exclude(pk=membership.pk)
    return others.count() + (1 if role == Membership.Role.OWNER else 0)


def _check_role(role: str) -> str:
    if role not in Membership.Role.values:
        raise InvalidInput(f"Unknown role '{role}'; roles are {', '.join(Membership.Role.values)}.",
                           code="unknown_role", param="role")
    return role


@transaction.atomic
def membership_add(*, tenant: Tenant, user_identifier: str, role: str) -> Membership:
    """Adds an existing user (by username or email) to the tenant with `role`."""
    _check_role(role)
    identifier = user_identifier.strip()
    users = get_user_model().objects
    user = users.filter(username=identifier).first() or (
        users.filter(email__iexact=identifier).first() if identifier else None)
    if user is None:
        raise InvalidInput(f"No user '{identifier}'. The platform operator creates accounts; then add them here.",
                           code="unknown_user", param="user")
    try:
        with transaction.atomic():
            return Membership.objects.create(user=user, tenant=tenant, role=role)
    except IntegrityError:
        raise Conflict(f"'{user.get_username()}' is already a member of '{tenant.slug}'.",
                       code="already_member", param="user") from None


@transaction.atomic
def membership_set_role(*, membership: Membership, role: str) -> Membership:
    """Changes a member's role; a tenant always keeps at least one owner."""
    _check_role(role)
    # The tenant's row lock serialises changes of its owners, so two demotions cannot both pass.
    Tenant.objects.select_for_update().filter(pk=membership.tenant_id).first()
    if membership.role == Membership.Role.OWNER and _owners_after(membership, role) == 0:
        raise Conflict(f"'{membership.user.get_username()}' is the last owner of '{membership.tenant.slug}'; make "
                       "someone else an owner first.", code="last_owner")
    membership.role = role
    membership.save(update_fields=["role"])
    return membership


@transaction.atomic
def membership_remove(*, membership: Membership) -> list[ApiKey]:
    """Removes a member (their account stays) and revokes the keys they created in the tenant, in
    one transaction; the keys revoked. The last owner cannot be removed."""
    # As in membership_set_role: one change of the tenant's owners at a time.
    Tenant.objects.select_for_update().filter(pk=membership.tenant_id).first()
    if membership.role == Membership.Role.OWNER and _owners_after(membership, None) == 0:
        raise Conflict(f"'{membership.user.get_username()}' is the last owner of '{membership.tenant.slug}'; make "
                       "someone else an owner first.", code="last_owner")
    revoked = api_keys_revoke_created_by(tenant=membership.tenant, user=membership.user)
    membership.delete()
    return revoked
