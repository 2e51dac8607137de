"""Deploy events on Redis pub/sub: how serving workers hear that a version starts or stops serving.

Channel `serving.contracts.registry.events_channel(<the Redis database>)`; one JSON message (`serving.contracts.registry.DeployEvent`) per audit
event, published only after the transaction that wrote it commits. Pub/sub delivers at most once, so a worker that was away misses
messages: it reconciles from the snapshot endpoint as well, and a failed publish is logged and
never undoes the committed change. The payload is described in docs/registry.md.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import redis
from django.conf import settings

from serving.registry.models import DeploymentEvent
from serving.contracts.registry import DeployEvent, ServedEntry, events_channel

logger = logging.getLogger(__name__)

# A publish is tried once and briefly: the request that caused it has already committed.
_SOCKET_TIMEOUT_S = 2.0


def event_payload(*, event: DeploymentEvent, served: list[ServedEntry],
                  dropped: list[ServedEntry]) -> dict[str, Any]:
    """The message for one audit event.

    `served` is the adapter's complete served set after the change (entries shaped like the
    snapshot's), so a worker can apply it without another lookup; `dropped` lists the versions this
    change stopped serving, which a worker may unload.
    """
    return DeployEvent(
        id=event.id, type=event.kind, at=event.created_at.isoformat(), tenant=event.tenant.slug,
        adapter=event.adapter_name, from_version=event.from_version or None, to_version=event.to_version or None,
        from_weight=event.from_weight, to_weight=event.to_weight, actor=event.actor, reason=event.reason,
        served=served, dropped=dropped,
    ).to_dict()


def deploy_event_publish(payload: dict[str, Any]) -> bool:
    """Publish one event; False (and a logged error) when Redis cannot be reached.

    Runs from transaction.on_commit, where an exception would turn a committed change into an
    error response, so every failure is caught here.
    """
    try:
        client = redis.Redis.from_url(
            settings.REDIS_URL, socket_timeout=_SOCKET_TIMEOUT_S, socket_connect_timeout=_SOCKET_TIMEOUT_S
        )
        try:
            client.publish(events_channel(int(client.connection_pool.connection_kwargs.get("db", 0))), json.dumps(payload))
        finally:
            client.close()
    except Exception:
        logger.exception(
            "Could not publish registry event %s (%s of %s/%s); workers will pick the change up "
            "from the registry snapshot", payload.get("id"), payload.get("type"), payload.get("tenant"),
            payload.get("adapter"),
        )
        return False
    return True
