"""Model signals of the tenants app.

A membership deleted by any path other than `services.membership_remove` (the admin's membership
pages, or its user or tenant deleted, which cascades) takes the keys its user created in the tenant
with it, as the service does: a departed member's keys never keep working.
"""

from __future__ import annotations

from typing import Any

from django.db.models.signals import pre_delete

from tenants import services
from tenants.models import Membership


def _revoke_keys_of_departing_member(sender: type[Membership], instance: Membership, **kwargs: Any) -> None:
    # pre_delete: the user still exists, so ApiKey.created_by (SET_NULL) still names them here.
    services.api_keys_revoke_created_by(tenant=instance.tenant, user=instance.user)


def connect() -> None:
    pre_delete.connect(_revoke_keys_of_departing_member, sender=Membership,
                       dispatch_uid="tenants.revoke_keys_of_departing_member")
