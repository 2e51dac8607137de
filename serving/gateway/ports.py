"""What the gateway's Django-free core is handed from its edge (serving.gateway.wiring builds them).

- `Catalog`: the one database port: who is calling, what a `model` names, what a key's usage
  records hold (its monthly budget's seed), which versions are still served.
  serving.gateway.catalog (the ORM, cached per process) is the implementation.
- `CanaryAbort`: aborts a canary in the registry (serving.registry.canary_guard, through the ORM); True
  when this call aborted it, False when there was nothing to abort (another process did, or the
  deployment changed meanwhile).

The usage flusher (serving.registry.usage, records from Redis into the database) is started by the wiring
module beside the pipeline's resources; the pipeline only pushes records to Redis.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from serving.gateway.records import Caller, Target
from serving.gateway.version_pick import ServedVersion


class Catalog(Protocol):
    async def caller_for(self, authorization: str | None) -> Caller:
        """The caller of an `Authorization` header; a GatewayError (401, 403) otherwise."""
        ...

    async def target_for(self, caller: Caller, model: str) -> Target:
        """What `model` names in the caller's tenant; a GatewayError (404) otherwise."""
        ...

    async def key_tokens_recorded(self, caller: Caller, start: float, before: float) -> int:
        """The tokens of the caller's key's usage records in [start, before) (unix seconds)."""
        ...

    async def served_versions(self, names: list[str]) -> dict[str, ServedVersion]:
        """The versions among `names` (qualified names) still served, by name."""
        ...

    def base_model_ids(self) -> list[str]:
        """The names that request the base model."""
        ...


CanaryAbort = Callable[[ServedVersion, str], Awaitable[bool]]
