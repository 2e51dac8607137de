"""Slot integrity (docs/resilience.md, "Slot integrity"): do a resident adapter's rows still hold
what was copied in?

An adapter's rows sit in device memory for hours; a stray write (a kernel bug, a bad copy, faulty
memory) would silently change what one tenant's requests get. So each adapter's content is summed
once, on the loader thread, from the CPU copy its rows are filled from, and the rows can be summed
again on the device later: a difference means they no longer hold the adapter. The sum is over the
raw bits, each tensor viewed as integers of its width and added in int64 (``raw_sum``): exact and
order-independent (a float sum could round a one-bit change away, and its result would depend on
the reduction order), and any single changed element changes it. Rows of a slice the adapter does
not target hold zeros, which add nothing, so the CPU copy's sum is the rows' sum. The slot table's
entry (scaling, rank, first row) is checked beside the rows, and so is the slot's row of DoRA's
scale tables where the engine has them (docs/adapter-kinds.md): those values are computed on the
device at load, so their sum is taken there too, when the slot is recorded, into a device tensor
(queued after the write, nothing read back), and compared on the device when verifying.

Recording costs nothing on the device for the rows (their expected sums are host integers) and one
small reduction queued there for a DoRA slot's scale rows, so the hot-load path waits for nothing. Verifying sums every pool row once, adds each slot's run of rows and reads the
sums back (one synchronisation), so it runs between steps, on demand or periodically, never inside
a decode step.
"""

from __future__ import annotations

import struct

import numpy
import torch

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_sum(tensor: torch.Tensor) -> int:
    """The sum of a CPU ``tensor``'s elements' raw bits, as signed integers of their width (in
    numpy: its widening sum is 15x torch's on the loader thread, where every load pays it)."""
    bits = tensor.detach().contiguous().view(_INT_OF_WIDTH[tensor.element_size()]).numpy()
    return int(bits.sum(dtype=numpy.int64))


def _entry_sum(scaling: float, rank: int, row: int) -> int:
    """What a slot table entry adds to its slot's sum: the fp32 scaling's bits, the rank, the row."""
    bits: int = struct.unpack("<i", struct.pack("<f", scaling))[0]
    return bits + rank + row


class SlotChecksums:
    def __init__(self, pools: list[torch.Tensor], scaling: torch.Tensor, ranks: torch.Tensor,
                 rows: torch.Tensor, scales: list[torch.Tensor] | None = None) -> None:
        """``pools``: every row pool of the model (first dimension: the row), contiguous;
        ``scaling`` (fp32), ``ranks`` and ``rows`` (int32): the slot table, one entry per slot;
        ``scales``: DoRA's scale tables (``[slots + 1, out]``, row ``slot + 1`` the slot's), if any."""
        self._pools = [t.view(_INT_OF_WIDTH[t.element_size()]) for t in pools]
        self._scaling_bits = scaling.view(torch.int32)
        self._ranks, self._rows = ranks, rows
        self._scales = [t.view(_INT_OF_WIDTH[t.element_size()]) for t in scales or []]
        # Each slot's scale rows' raw-bit sum as recorded, on the device (where they were computed).
        self._scale_expected = torch.zeros(scaling.shape[0], dtype=torch.int64, device=scaling.device)
        self._expected: dict[int, int] = {}
        self.checks = 0
        self.mismatches = 0

    def record(self, slot: int, *, content: int, scaling: float, rank: int, row: int) -> None:
        """Remember what ``slot`` holds once its copy lands: rows whose raw-bit sum is ``content``
        (``raw_sum`` of the CPU copy) and its table entry; and its DoRA scale rows as they are now
        written (call it after they are: the sum is queued behind the write on the same stream)."""
        self._expected[slot] = content + _entry_sum(scaling, rank, row)
        if self._scales:
            self._scale_expected[slot] = sum(t[slot + 1].sum(dtype=torch.int64) for t in self._scales)

    def forget(self, slot: int) -> None:
        self._expected.pop(slot, None)

    def mismatched(self, placed: list[tuple[int, int, int]]) -> list[int]:
        """Which of ``placed`` (``(slot, row, rank)`` of each resident adapter) no longer sum to what
        they were written with."""
        self.checks += 1
        if not placed or not self._pools:
            return []
        device = self._pools[0].device
        row_sums = torch.zeros(self._pools[0].shape[0], dtype=torch.int64, device=device)
        for t in self._pools:
            row_sums += t.reshape(t.shape[0], -1).sum(dim=1, dtype=torch.int64)
        # Each slot's run of rows, as a difference of the running sum (its first row's prefix excluded).
        prefix = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(row_sums, 0)])
        slots = torch.tensor([s for s, _, _ in placed], dtype=torch.long, device=device)
        starts = torch.tensor([r for _, r, _ in placed], dtype=torch.long, device=device)
        ends = starts + torch.tensor([n for _, _, n in placed], dtype=torch.long, device=device)
        actual = prefix[ends] - prefix[starts]
        actual += self._scaling_bits[slots].long() + self._ranks[slots].long() + self._rows[slots].long()
        scales_changed = torch.zeros_like(actual)
        if self._scales:
            scales_changed = (self._scale_sums()[slots] != self._scale_expected[slots]).long()
        read = torch.stack([actual, scales_changed]).tolist()  # the one read back
        bad = [slot for (slot, _, _), value, changed in zip(placed, *read) if changed or value != self._expected[slot]]
        self.mismatches += len(bad)
        return bad

    def _scale_sums(self) -> torch.Tensor:
        """Every slot's raw-bit sum of its DoRA scale rows over all tables, ``[slots]`` int64 on the device."""
        return torch.stack([t[1:].sum(dim=1, dtype=torch.int64) for t in self._scales]).sum(dim=0)


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

    def __reduce__(self) -> tuple[type[SlotCorruptedError], tuple[str, int]]:
        # Rebuilt from its fields: it crosses from the engine-core process to the server's.
        return type(self), (self.name, self.slot)
