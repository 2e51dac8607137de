"""The adapter names this worker serves: the engine's named adapters, mirrored here so that
resolving a request's `model` costs a dict lookup instead of a round trip to the engine thread.

Every load and unload goes through `AdapterSet`, which updates the mirror only after the engine
has done the change, one change per name at a time. Every location but the command line's is
checked against the allowed roots first (adapter_roots.py). Each name records who loaded it
(`--lora-modules`, the HTTP API, or registry sync) and when, which registry reconciliation uses to
leave alone what was loaded after the snapshot it applies was taken.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from serving.engine import EngineClient, LoRAInfo, LoRARequest
from serving.engine.server.adapter_roots import AdapterRoots

log = logging.getLogger(__name__)


class Source(str, Enum):
    COMMAND_LINE = "command_line"
    API = "api"
    REGISTRY = "registry"


@dataclass(frozen=True)
class ServedAdapter:
    info: LoRAInfo
    source: Source
    loaded_at: float  # time.monotonic()


class AdapterSet:
    def __init__(self, engine: EngineClient, *, base_model_ids: list[str], roots: AdapterRoots,
                 on_change: Callable[[], None]) -> None:
        self._engine = engine
        self._roots = roots
        self._base_ids = set(base_model_ids)
        self._on_change = on_change
        self._served: dict[str, ServedAdapter] = {}
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    def get(self, name: str) -> ServedAdapter | None:
        return self._served.get(name)

    def all(self) -> dict[str, ServedAdapter]:
        return dict(self._served)

    async def load(self, name: str, path: str, *, load_inplace: bool, source: Source,
                   background: bool = False) -> LoRAInfo:
        """Load (or, with `load_inplace`, replace) `name`; AdapterError with the engine's reason.
        `background`: a prefetch's load, read where requests never wait behind it.

        Loading a name again with the same content is a no-op that succeeds. A location outside
        the allowed roots raises AdapterLocationRefused before anything is read."""
        if name in self._base_ids:
            raise ValueError(f"'{name}' is the base model's id; choose another adapter name")
        location = path if source is Source.COMMAND_LINE else self._roots.check(path)
        async with self._locks[name]:
            info = await self._engine.add_lora(LoRARequest(name, location), load_inplace=load_inplace,
                                               background=background)
            previous = self._served.get(name)
            self._served[name] = ServedAdapter(info=info, source=source, loaded_at=time.monotonic())
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
