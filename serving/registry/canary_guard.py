"""Automatic canary abort: the registry's own abort, by actor `system:canary-guard`.

The gateway judges canaries by their breakers (serving.gateway.canary_rule) and calls
`canary_guard_abort` off the request path. Several gateway processes may reach the same verdict at
once, and by then an operator may have promoted or aborted the canary, or started another one: the
adapter's row is locked first and the abort runs only if the judged version is still the canary,
so one failing canary gives exactly one audit event. The abort itself is
serving.registry.services.adapter_canary_abort, which writes the event and publishes the deploy event that
tells the workers.
"""

from __future__ import annotations

import logging

from django.db import transaction

from serving.registry import selectors, services
from serving.registry.models import Adapter, DeploymentEvent

logger = logging.getLogger(__name__)

# The audit log's actor of an automatic abort.
ACTOR = "system:canary-guard"


def canary_guard_abort(*, tenant_slug: str, adapter_name: str, version: str, reason: str) -> DeploymentEvent | None:
    """Aborts `version` if it is still the adapter's canary; its audit event, or None if it was not."""
    with transaction.atomic():
        adapter = (Adapter.objects.select_for_update(of=("self",)).select_related("tenant")
                   .filter(tenant__slug=tenant_slug, name=adapter_name).first())
        if adapter is None:
            return None
        _, canary = selectors.adapter_served(adapter=adapter)
        if canary is None or canary.version != version:
            logger.info("canary guard: %s/%s@%s is no longer the canary; nothing to abort",
                        tenant_slug, adapter_name, version)
            return None
        services.adapter_canary_abort(adapter=adapter, actor=ACTOR, reason=reason)
        event = DeploymentEvent.objects.filter(adapter=adapter).order_by("-id").first()
    logger.warning("canary guard aborted %s/%s@%s: %s", tenant_slug, adapter_name, version, reason)
    return event
