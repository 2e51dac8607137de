"""Slot integrity (docs/resilience.md, "Slot integrity"): is what a GPU slot holds still what was
copied in?

A slot's weights sit in device memory for hours; a stray write (a kernel bug, a bad copy, faulty
memory) would silently change what one tenant's requests get. So each slot's content is summed
when it is written and can be summed again later: a difference means the slot no longer holds its
adapter. The sum is over the raw bits, each slot tensor viewed as integers of its width and added
in int64: exact and order-independent (a float sum could round a one-bit change away, and its
result would depend on the reduction order), and any single changed element changes it.

Recording runs on the device and never synchronises: it is one small reduction per slot tensor
queued after the slot copy, so the hot-load path waits for nothing. Verifying compares every slot
at once and reads one boolean per slot back (one synchronisation), so it runs between steps, on
demand or periodically, never inside a decode step.
"""

from __future__ import annotations

import torch

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class SlotChecksums:
    def __init__(self, tensors: list[torch.Tensor], num_slots: int) -> None:
        """``tensors``: every per-slot tensor of the model (first dimension: the slot), contiguous."""
        self._tensors = [t.view(_INT_OF_WIDTH[t.element_size()]) for t in tensors]
        device = tensors[0].device if tensors else torch.device("cpu")
        self._expected = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.checks = 0
        self.mismatches = 0

    def record(self, slot: int) -> None:
        """Remember ``slot``'s sum as written just now (queued on the device, no synchronisation)."""
        total = torch.zeros((), dtype=torch.int64, device=self._expected.device)
        for t in self._tensors:
            total += t[slot].sum(dtype=torch.int64)
        self._expected[slot] = total

    def mismatched(self, slots: list[int]) -> list[int]:
        """Which of ``slots`` (those holding an adapter) no longer sum to what they were written with."""
        self.checks += 1
        if not slots:
            return []
        actual = torch.zeros_like(self._expected)
        for t in self._tensors:
            actual += t.reshape(t.shape[0], -1).sum(dim=1, dtype=torch.int64)
        differs = (actual != self._expected).tolist()
        bad = [slot for slot in slots if differs[slot]]
        self.mismatches += len(bad)
        return bad


class SlotCorruptedError(RuntimeError):
    """A request was stopped because the GPU slot it ran on failed its checksum: the tokens it had
    produced came from weights that were no longer its adapter's. Nothing is wrong with the request
    or the adapter in storage (the slot is being reloaded from there), so a retry is served right."""

    def __init__(self, name: str, slot: int) -> None:
        super().__init__(
            f"adapter '{name}' was stopped mid-generation: GPU slot {slot} it ran on failed its checksum "
            "(its weights changed in memory), so the output so far is not the adapter's; the slot is being "
            "reloaded from storage, retry the request"
        )
        self.name = name
        self.slot = slot
