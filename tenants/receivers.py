"""Model signals of the tenants app.

A membership deleted by any path other than `services.membership_remove` (the admin's membership
pages, or its user or tenant deleted, which cascades) takes the keys its user created in the tenant
with it, as the service does: a departed member's keys never keep working. Likewise a user whose
account is deactivated (`is_active` set false: the admin's user page, `manage.py`, any save) loses
the keys they created in every tenant: a person who may no longer sign in must not keep calling the
API with what they minted.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.db.models.signals import post_save, pre_delete, pre_save

from tenants import services
from tenants.models import Membership


def _revoke_keys_of_departing_member(sender: type[Membership], instance: Membership, **kwargs: Any) -> None:
    # pre_delete: the user still exists, so ApiKey.created_by (SET_NULL) still names them here.
    services.api_keys_revoke_created_by(tenant=instance.tenant, user=instance.user)


def _note_deactivation(sender: type[Any], instance: Any, **kwargs: Any) -> None:
    # pre_save sees the stored row: only a change from active to inactive revokes.
    instance._loraplex_deactivated = bool(
        instance.pk is not None and not instance.is_active
        and sender.objects.filter(pk=instance.pk, is_active=True).exists()
    )


def _revoke_keys_of_deactivated_user(sender: type[Any], instance: Any, **kwargs: Any) -> None:
    if not getattr(instance, "_loraplex_deactivated", False):
        return
    instance._loraplex_deactivated = False
    for membership in Membership.objects.filter(user=instance).select_related("tenant"):
        services.api_keys_revoke_created_by(tenant=membership.tenant, user=instance, deactivated=True)


def connect() -> None:
    pre_delete.connect(_revoke_keys_of_departing_member, sender=Membership,
                       dispatch_uid="tenants.revoke_keys_of_departing_member")
    user_model = get_user_model()
    pre_save.connect(_note_deactivation, sender=user_model, dispatch_uid="tenants.note_deactivation")
    post_save.connect(_revoke_keys_of_deactivated_user, sender=user_model,
                      dispatch_uid="tenants.revoke_keys_of_deactivated_user")
