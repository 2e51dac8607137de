"""What one request is, as the gateway's steps see it: the caller, what its `model` names, and the
call as it moves through the path (serving.gateway.pipeline), plus the reply the edge sends.

Plain records, Django-free: the catalog (serving.gateway.catalog) fills `Caller` and `Target`
from the database; the pipeline fills `Call` with each step's answer, which the resilience rules
(serving.gateway.resilience) read and never write. Living here, they leave no module importing
its caller back.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from serving.gateway.key_budget import Reservation
from serving.gateway.quotas import Admission
from serving.gateway.version_pick import ServedSet, ServedVersion
from runtime.breakers import Permit
from serving.contracts.request_ids import request_id_current, request_id_mint


@dataclass(frozen=True)
class TierLimits:
    name: str
    requests_per_minute: int
    tokens_per_minute: int
    max_tokens_per_request: int
    priority: int
    degradation_allowed: bool


@dataclass(frozen=True)
class KeyControls:
    """An API key's own controls (docs/keys.md) that the gateway applies beside its tier's limits;
    None or empty: none of its own. (Its expiry is checked where the key is authenticated.)"""

    # The only models the key may call (tenants.key_controls.model_allowed); empty: all the tenant's.
    allowed_models: tuple[str, ...] = ()
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    monthly_token_budget: int | None = None


@dataclass(frozen=True)
class Caller:
    """An authenticated inference caller: its tenant, its key's public prefix, its tier's limits
    and its key's own."""

    tenant_id: int
    tenant: str
    key_prefix: str
    tier: TierLimits
    key: KeyControls = field(default_factory=KeyControls)


@dataclass(frozen=True)
class Target:
    """What a request's `model` resolved to: the base model, an adapter's served set, or a pin."""

    base: bool = False
    served: ServedSet | None = None
    pinned: ServedVersion | None = None

    @property
    def adapter(self) -> str | None:
        version = self.pinned or (self.served.active if self.served else None)
        return version.adapter if version else None


@dataclass
class Call:
    """One request's state as it moves through the steps."""

    endpoint: str
    caller: Caller
    body: dict[str, Any]
    model: str
    target: Target
    max_tokens: int  # per completion
    # Completions the request generates (prompts x max(n, best_of)): the reservation covers them all.
    sequences: int = 1
    reserved_tokens: int = 0
    prompt_estimate: int = 0
    admission: Admission | None = None
    # The request body's size in bytes: what bounds its prompt's tokens (serving.gateway.accounting).
    body_bytes: int = 0
    # The tokens held against the key's monthly budget (serving.gateway.key_budget), released when
    # the call is settled; None for a key without a budget, or while Redis is away.
    budget_reservation: Reservation | None = None
    degraded: bool = False
    version: ServedVersion | None = None
    # The version's circuit-breaker permit (None on the base model).
    permit: Permit | None = None
    # The request's X-Request-ID (serving.contracts.request_ids: the edge's, or minted here outside one).
    request_id: str = field(default_factory=lambda: request_id_current() or request_id_mint())
    started: float = field(default_factory=time.perf_counter)
    headers: dict[str, str] = field(default_factory=dict)


class EventStream(Protocol):
    """A streamed reply's events (serving.gateway.proxy.Relay), closed by whoever sends them."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


@dataclass
class Reply:
    """What the edge sends: a whole body, or a stream of SSE events."""

    status: int
    headers: dict[str, str]
    body: bytes = b""
    stream: EventStream | None = None  # closed (aclose) by whoever sends it
