"""The adapter names this worker serves: the engine's named adapters, mirrored here so that
resolving a request's `model` costs a dict lookup instead of a round trip to the engine thread.

Every load and unload goes through `AdapterSet`, which updates the mirror only after the engine
has done the change, one change per name at a time. Each name also records who loaded it
(`--lora-modules`, the HTTP API, or registry sync), so registry reconciliation only ever unloads
what it loaded itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from serving.engine import AsyncEngine, LoRAInfo, LoRARequest

log = logging.getLogger(__name__)


class Source(str, Enum):
    COMMAND_LINE = "command_line"
    API = "api"
    REGISTRY = "registry"


@dataclass(frozen=True)
class ServedAdapter:
    info: LoRAInfo
    source: Source


class AdapterSet:
    def __init__(self, engine: AsyncEngine, *, base_model_ids: list[str], on_change: Callable[[], None]) -> None:
        self._engine = engine
        self._base_ids = set(base_model_ids)
        self._on_change = on_change
        self._served: dict[str, ServedAdapter] = {}
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    def get(self, name: str) -> ServedAdapter | None:
        return self._served.get(name)

    def all(self) -> dict[str, ServedAdapter]:
        return dict(self._served)

    def from_source(self, source: Source) -> dict[str, ServedAdapter]:
        return {name: s for name, s in self._served.items() if s.source is source}

    async def load(self, name: str, path: str, *, load_inplace: bool, source: Source) -> LoRAInfo:
        """Load (or, with `load_inplace`, replace) `name`; AdapterError with the engine's reason.

        Loading a name again with the same content is a no-op that succeeds."""
        if name in self._base_ids:
            raise ValueError(f"'{name}' is the base model's id; choose another adapter name")
        async with self._locks[name]:
            info = await self._engine.add_lora(LoRARequest(name, path), load_inplace=load_inplace)
            previous = self._served.get(name)
            self._served[name] = ServedAdapter(info=info, source=source)
        if previous is None or previous.info.digest != info.digest:
            log.info("adapter %s loaded from %s (digest %s, rank %d, %s)", name, path, info.digest[:12], info.rank, source.value)
        self._on_change()
        return info

    async def unload(self, name: str) -> None:
        """Unload `name`; AdapterNotFoundError if it is not loaded. In-flight requests finish."""
        async with self._locks[name]:
            try:
                await self._engine.remove_lora(name)
            finally:
                removed = self._served.pop(name, None)
        if removed is not None:
            log.info("adapter %s unloaded", name)
        self._on_change()
