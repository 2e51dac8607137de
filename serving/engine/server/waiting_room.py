"""The worker's room for requests in flight (running and queued), shared fairly between tenants.

The room holds `max_num_seqs + max_queued_requests` requests; past that a request is refused with
503 and the gateway tries another worker. Counted across everyone alone, one tenant flooding a
worker fills the room and every other tenant gets 503 before the engine (whose scheduler shares
the batch between tenants, serving.engine.fairness) ever sees them. So the last eighth of the room
(at least one place) is kept for tenants holding less than an equal share of it: a tenant holding
`capacity // (tenants in the room + 1)` or more is refused there, a newcomer is not. Under no
contention a tenant uses seven eighths of the room, enough for any sane queue; several flooders
share the rest of it down to their equal shares.

A request's tenant is its cache salt (the gateway sets one per tenant, serving.gateway.upstream);
unsalted requests are the operator's own (benchmarks, direct calls) and only the room's size
bounds them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

# The share of the room kept for tenants under their equal share (docs/security.md).
RESERVED_FRACTION = 8


class WaitingRoom:
    """Request ids in flight, by tenant."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.reserved = max(1, capacity // RESERVED_FRACTION)
        self._tenant: dict[str, str | None] = {}
        self._held: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._tenant)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._tenant))

    def __bool__(self) -> bool:
        return bool(self._tenant)

    def refusal(self, tenant: str | None) -> str | None:
        """Why a request of `tenant` cannot come in now (None: it can)."""
        inflight = len(self._tenant)
        if inflight >= self.capacity:
            return "full"
        if tenant is None or self.capacity - inflight > self.reserved:
            return None
        held = self._held[tenant]
        tenants = len(self._held) + (0 if held else 1)
        return "tenant_share" if held and held >= self.capacity // (tenants + 1) else None

    def enter(self, request_id: str, tenant: str | None) -> None:
        self._tenant[request_id] = tenant
        if tenant is not None:
            self._held[tenant] += 1

    def leave(self, request_id: str) -> None:
        if request_id not in self._tenant:
            return
        tenant = self._tenant.pop(request_id)
        if tenant is not None:
            self._held[tenant] -= 1
            if not self._held[tenant]:
                del self._held[tenant]

    def held(self, tenant: str) -> int:
        return self._held[tenant]
