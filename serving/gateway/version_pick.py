"""Which version serves a request for an unpinned adapter name: the active one, or the canary by
its traffic weight. With OpenAI's `user` field the choice is sticky: the user's id is hashed with
the adapter into a fixed point of [0, 1), so one user's conversation stays on one version for as
long as the weight does not move past that point (raising the weight only ever moves users onto
the canary, lowering it only off it)."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from serving.contracts.names import qualified_name


@dataclass(frozen=True)
class ServedVersion:
    """A version the gateway can route to, as the registry describes it to workers."""

    tenant: str
    adapter: str
    version: str
    artifact_uri: str
    manifest_sha256: str
    status: str

    @property
    def qualified_name(self) -> str:
        """`<tenant>/<adapter>@<version>`: the name between the gateway and serving workers."""
        return qualified_name(tenant=self.tenant, adapter=self.adapter, version=self.version)


@dataclass(frozen=True)
class ServedSet:
    """An adapter's active version and its canary (with the canary's share of traffic)."""

    active: ServedVersion
    canary: ServedVersion | None = None
    canary_weight: float = 0.0


def user_point(user: str, *, tenant: str, adapter: str) -> float:
    """A stable point in [0, 1) for this user of this adapter (sha256, so no process sees another
    mapping: Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"{tenant}\x00{adapter}\x00{user}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def pick_version(served: ServedSet, *, user: str | None, rng: random.Random | None = None) -> ServedVersion:
    """The canary with probability `canary_weight` (by the user's point when a user is named)."""
    if served.canary is None or served.canary_weight <= 0.0:
        return served.active
    if user:
        point = user_point(user, tenant=served.active.tenant, adapter=served.active.adapter)
    else:
        point = (rng or random).random()
    return served.canary if point < served.canary_weight else served.active
