"""Everything that changes tenants, memberships and API keys."""

from __future__ import annotations

import logging

from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from django.core.validators import validate_email
from django.db import IntegrityError, transaction
from django.db.models import CharField, Model
from django.utils import timezone
from django.utils.text import slugify

from serving.wire.errors import Conflict, InvalidInput
from tenants.api_keys import generate_key, hash_secret
from tenants.models import ApiKey, Membership, Tenant, Tier
from tenants.selectors import tenant_by_slug
from tenants.tiers import DEFAULT_TIERS

log = logging.getLogger(__name__)

DEFAULT_SCOPES = [ApiKey.Scope.INFERENCE.value, ApiKey.Scope.MANAGE.value]


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


def api_key_create(*, tenant: Tenant, name: str, scopes: list[str] | None = None,
                   created_by: User | None = None) -> tuple[ApiKey, str]:
    """A new key for the tenant: (the row, the full key, which is never retrievable again).

    `created_by` is the member it belongs to (revoked when they leave the tenant); None for the
    operator's keys. Who may create keys is the callers' business (tenants.permissions).
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
    full_key, parts = generate_key()
    key = ApiKey.objects.create(
        tenant=tenant, name=name.strip(), prefix=parts.prefix, secret_hash=hash_secret(parts.secret),
        scopes=sorted(set(scopes)), created_by=created_by,
    )
    return key, full_key


def api_key_revoke(*, api_key: ApiKey) -> ApiKey:
    """Revoking is idempotent: the first revocation time is kept."""
    if api_key.revoked_at is None:
        api_key.revoked_at = timezone.now()
        api_key.save(update_fields=["revoked_at"])
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
        for earlier in ApiKey.objects.filter(tenant=tenant, name=name, created_by=user, revoked_at__isnull=True):
            api_key_revoke(api_key=earlier)
        return api_key_create(tenant=tenant, name=name, scopes=[ApiKey.Scope.INFERENCE.value], created_by=user)


def api_keys_revoke_created_by(*, tenant: Tenant, user: User) -> list[ApiKey]:
    """Revokes the live keys `user` created in `tenant` (they leave it); the keys revoked.

    There is no audit table for keys: each revocation is a log line naming the key and its creator.
    """
    now = timezone.now()
    with transaction.atomic():
        keys = list(ApiKey.objects.select_for_update().filter(tenant=tenant, created_by_id=user.pk,
                                                              revoked_at__isnull=True))
        ApiKey.objects.filter(pk__in=[key.pk for key in keys]).update(revoked_at=now)
    for key in keys:
        key.revoked_at = now
        log.info("API key lp-%s… (%s) of tenant %s revoked: its creator %s left the tenant", key.prefix, key.name,
                 tenant.slug, user.get_username())
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
