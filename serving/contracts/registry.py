"""The registry ↔ serving-worker wire: the one place both sides spell it (docs/registry.md).

Django-free, so the serving worker imports it as the registry does:

- `events_channel()`: the Redis pub/sub channel of deploy events (one JSON `DeployEvent` each).
- `ServedEntry`: how the snapshot (`RegistrySnapshot`) and the events describe one served version.
- `WORKERS_KEY` / `worker_key()`: where a worker registers itself in Redis for the gateway.
- `api_key_id()`: the fingerprint of a worker's key in its registration, so a gateway routes only
  to workers that accept the key it sends.
- `SLOT_CORRUPTED`: the error code of a request the worker stopped because its adapter's GPU slot
  failed its checksum, which the gateway must not charge to the version again.

Each typed entry has `to_dict()` (what goes on the wire, JSON-ready) and `from_dict()` (which
raises ValueError naming what is missing or mistyped), and `from_dict(to_dict(x)) == x`.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

from serving.contracts import names

EVENTS_CHANNEL = "loraplex:registry:events"


def events_channel(database: int) -> str:
    """The deploy-events channel of a registry whose Redis keys live in database `database`.

    Redis pub/sub ignores the database: every client of a server hears every channel. Two
    deployments sharing a server on different databases (or two test workers) would apply each
    other's deploys, and an event id of the other's audit log, higher than any of its own, would make
    a worker skip its own registry's snapshots as older. The database is part of the name.
    """
    return f"{EVENTS_CHANNEL}:db{database}"

# A sorted set of worker ids scored by their last heartbeat, and one JSON document per worker.
WORKERS_KEY = "loraplex:serving:workers"
WORKER_KEY_PREFIX = "loraplex:serving:worker:"

# The `code` of a worker's error (a 503, or a stream's error event) for a request stopped because
# its adapter's GPU slot failed its checksum: the worker has charged the version's breaker for it
# already, so the gateway counts it as the worker's state (docs/resilience.md, "Slot integrity").
SLOT_CORRUPTED = "adapter_slot_corrupted"

# Idle connections between the gateway and a worker: the worker keeps one open for
# WORKER_KEEP_ALIVE_S and the gateway's pool drops its own well before, after UPSTREAM_IDLE_S. With
# both at the libraries' default 5 s, a gateway loop lagging under load takes a pooled connection
# that still looks open and writes its request just after the worker closed it: a ReadError before
# the first byte, retried elsewhere but charged to that worker (seen with bench/serve.py's client at
# 256 streams, docs/benchmarks.md). The side that closes first must be the client.
WORKER_KEEP_ALIVE_S = 75
UPSTREAM_IDLE_S = 30.0


def worker_key(worker_id: str) -> str:
    """The Redis key of one worker's registration document."""
    return f"{WORKER_KEY_PREFIX}{worker_id}"


def api_key_id(api_key: str | None) -> str | None:
    """The fingerprint a worker publishes of its key (None for a worker without one, which accepts any).

    A worker keyed differently from a gateway would answer every call with 401, which the client
    would read as its own key being wrong; the gateway skips such workers instead. The key is 256
    random bits, so a truncated SHA-256 of it in Redis reveals nothing usable.
    """
    if not api_key:
        return None
    return hashlib.sha256(b"loraplex-worker-key:" + api_key.encode()).hexdigest()[:16]


def _field(data: Any, key: str, kinds: type | tuple[type, ...], *, optional: bool = False) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"a registry entry must be a JSON object, got {data!r:.200}")
    if key not in data:
        raise ValueError(f"registry entry without {key!r}: {data!r:.300}")
    value = data[key]
    if value is None and optional:
        return None
    # bool is an int; a flag where a number belongs is a mistake, not a number.
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ValueError(f"registry entry field {key!r} has the wrong type: {value!r:.100}")
    if not isinstance(value, kinds):
        raise ValueError(f"registry entry field {key!r} has the wrong type: {value!r:.100}")
    return value


@dataclass(frozen=True)
class ServedEntry:
    """One version the registry serves (or, in an event's `dropped`, stopped serving)."""

    name: str  # <tenant>/<adapter>@<version>: the worker loads it under this name
    tenant: str
    adapter: str
    version: str
    status: str
    weight: float | None  # the share of the adapter's traffic; None where not served
    artifact_uri: str
    manifest_sha256: str
    base_model: str
    rank: int
    # The base's commit the version was built on ("": a plain directory, or a registry from before
    # revisions were recorded); a worker serving another commit refuses it.
    base_model_revision: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> ServedEntry:
        weight = _field(data, "weight", (int, float), optional=True)
        return cls(
            name=_field(data, "name", str), tenant=_field(data, "tenant", str), adapter=_field(data, "adapter", str),
            version=_field(data, "version", str), status=_field(data, "status", str),
            weight=None if weight is None else float(weight), artifact_uri=_field(data, "artifact_uri", str),
            manifest_sha256=_field(data, "manifest_sha256", str), base_model=_field(data, "base_model", str),
            rank=_field(data, "rank", int),
            base_model_revision=_field(data, "base_model_revision", str, optional=True) or "",
        )


@dataclass(frozen=True)
class RegistrySnapshot:
    """Everything workers should keep resident; `revision` is the newest audit event it reflects."""

    revision: int
    base_model: str
    adapters: list[ServedEntry] = field(default_factory=list)
    base_model_revision: str = ""  # the platform's base commit ("": a plain directory)

    def to_dict(self) -> dict[str, Any]:
        return {"revision": self.revision, "base_model": self.base_model,
                "base_model_revision": self.base_model_revision,
                "adapters": [entry.to_dict() for entry in self.adapters]}

    @classmethod
    def from_dict(cls, data: Any) -> RegistrySnapshot:
        adapters = _field(data, "adapters", list)
        return cls(revision=_field(data, "revision", int), base_model=_field(data, "base_model", str),
                   adapters=[ServedEntry.from_dict(entry) for entry in adapters],
                   base_model_revision=_field(data, "base_model_revision", str, optional=True) or "")


@dataclass(frozen=True)
class DeployEvent:
    """One audit event as published on `EVENTS_CHANNEL` after its transaction commits.

    `served` is the adapter's complete served set after the change, so a worker applies it without
    another lookup; `dropped` lists the versions the change stopped serving.
    """

    id: int
    type: str
    at: str  # ISO 8601
    tenant: str
    adapter: str
    from_version: str | None
    to_version: str | None
    from_weight: float | None
    to_weight: float | None
    actor: str
    reason: str
    served: list[ServedEntry] = field(default_factory=list)
    dropped: list[ServedEntry] = field(default_factory=list)

    @property
    def name_prefix(self) -> str:
        """What every served name of this event's adapter starts with."""
        return names.name_prefix(tenant=self.tenant, adapter=self.adapter)

    def to_dict(self) -> dict[str, Any]:
        return {**{key: value for key, value in asdict(self).items() if key not in ("served", "dropped")},
                "served": [entry.to_dict() for entry in self.served],
                "dropped": [entry.to_dict() for entry in self.dropped]}

    @classmethod
    def from_dict(cls, data: Any) -> DeployEvent:
        def weight(key: str) -> float | None:
            value = _field(data, key, (int, float), optional=True)
            return None if value is None else float(value)

        return cls(
            id=_field(data, "id", int), type=_field(data, "type", str), at=_field(data, "at", str),
            tenant=_field(data, "tenant", str), adapter=_field(data, "adapter", str),
            from_version=_field(data, "from_version", str, optional=True),
            to_version=_field(data, "to_version", str, optional=True),
            from_weight=weight("from_weight"), to_weight=weight("to_weight"),
            actor=_field(data, "actor", str), reason=_field(data, "reason", str),
            served=[ServedEntry.from_dict(entry) for entry in _field(data, "served", list)],
            dropped=[ServedEntry.from_dict(entry) for entry in _field(data, "dropped", list)],
        )
