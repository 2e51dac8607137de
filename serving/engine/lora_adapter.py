"""The records the adapter cache's parts share: one adapter's content, and a request's handle on it.

``Adapter`` is one content (one digest) and where it is resident right now; the slot table, the
CPU cache and the model runner read and write its residency fields. ``AdapterHandle`` is what a
request holds from the moment it is queued: it starts out waiting on a first load and is pointed
at its ``Adapter`` when that load finishes, so the sequence and the scheduler see one type for the
whole life of a request, whatever the adapter's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from serving.engine.lora_loader import PendingLoad

# (layer index, module name) -> (A[r, in], B[out, r]) in the model's dtype.
Weights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False)
class Adapter:
    """One adapter's content (one digest) and where it is resident.

    It stays alive while anything holds it: a name (``names``), a request (``handles``) or a
    re-read in flight (``reload``); the cache frees its slot and CPU copy when the last one goes.
    A running sequence pins its slot (``running``) and always holds a handle too."""

    digest: str
    path: str
    rank: int
    lora_alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    weights: Weights | None
    load_seconds: float
    names: set[str] = field(default_factory=set)
    slot: int | None = None
    handles: set[AdapterHandle] = field(default_factory=set)  # unfinished requests that use it
    running: int = 0  # running sequences: they pin the slot
    reload: PendingLoad | None = None
    repairing: bool = False  # its slot failed a checksum: the re-read in flight puts it back in one

    @property
    def refs(self) -> int:
        """Unfinished requests that use it."""
        return len(self.handles)

    @property
    def unused(self) -> bool:
        return not self.names and not self.handles and self.running == 0 and self.reload is None


@dataclass(eq=False)
class AdapterHandle:
    """A request's reference to its adapter, stable from queueing to finish.

    ``adapter`` is None while the first load of the request's name is in flight (``load``); the
    cache sets it when that load finishes. ``stalled`` records that the request had to wait for a
    load, so each request counts once in the load-stall counter however many steps it waits."""

    name: str
    adapter: Adapter | None = None
    load: PendingLoad | None = None
    stalled: bool = False
