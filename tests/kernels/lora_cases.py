"""Random multi-LoRA cases, an exact fp64 oracle and the error bound the implementations must meet.

``Case`` holds slot tensors; ``PoolCase`` the same adapters re-laid in row pools (``pooled``), with
its own oracle read from the pool rows.

Error bound (per output element), with ``M = |y0| + |scaling[s]| * |B[s]| @ (|A[s]| @ |x|)`` the
magnitude of everything summed into it:

- fp32: both sides accumulate in fp32, in different orders; a length-n sum has error at most
  ``n * 2^-24 * M``, with n = K for the shrink and R for the expand, plus the final add.
- bf16 / fp16: the intermediate ``h`` and the output are each rounded once to the dtype (unit
  roundoff u = 2^-8 for bf16, 2^-11 for fp16; Triton's interpreter truncates instead of rounding, up
  to 2u). Each implementation is within ``2u * M`` of the exact result (h rounding, then output
  rounding) plus the fp32 part, so two implementations differ by at most ``4u * M`` plus that.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from kernels import LoRAMeta, LoRAWeights

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@dataclass
class Case:
    y: torch.Tensor
    x: torch.Tensor
    As: list[torch.Tensor]
    Bs: list[torch.Tensor]
    scaling: torch.Tensor
    slots: torch.Tensor
    offsets: list[int]
    ranks: torch.Tensor | None

    def meta(self) -> LoRAMeta:
        return LoRAMeta.build(self.slots, self.As[0].shape[0])

    def exact(self) -> torch.Tensor:
        """``y0 + scaling * B @ (A @ x)`` per token in fp64, every token gathered (small cases)."""
        out = self.y.double().clone()
        active = self.slots >= 0
        s = self.slots[active].long()
        x = self.x[active].double().unsqueeze(-1)
        for A, B, offset in zip(self.As, self.Bs, self.offsets):
            h = torch.bmm(A.double()[s], x)
            delta = torch.bmm(B.double()[s], h).squeeze(-1) * self.scaling.double()[s].unsqueeze(-1)
            out[active, offset : offset + B.shape[1]] += delta
        return out

    def bound(self) -> torch.Tensor:
        """The largest difference two correct implementations may show (module docstring)."""
        magnitude = self.y.double().abs().clone()
        active = self.slots >= 0
        s = self.slots[active].long()
        x = self.x[active].double().abs().unsqueeze(-1)
        for A, B, offset in zip(self.As, self.Bs, self.offsets):
            h = torch.bmm(A.double().abs()[s], x)
            m = torch.bmm(B.double().abs()[s], h).squeeze(-1) * self.scaling.double().abs()[s].unsqueeze(-1)
            magnitude[active, offset : offset + B.shape[1]] += m
        return _bound(magnitude, self.x, self.As[0].shape[1])


def _bound(magnitude: torch.Tensor, x: torch.Tensor, rank: int) -> torch.Tensor:
    """The error bound of the module docstring for elements of ``magnitude`` (K = x's width)."""
    fp32_part = 2 * (x.shape[1] + rank + 2) * UNIT_ROUNDOFF[torch.float32]
    dtype_part = 0.0 if x.dtype == torch.float32 else 4 * UNIT_ROUNDOFF[x.dtype]
    return (dtype_part + fp32_part) * magnitude + 1e-30


@dataclass
class PoolCase:
    """A step over row pools: ``As[i] [P, K]``, ``Bs[i] [P, N_i]`` (B transposed), slot ``s`` owning
    pool rows ``rows[s] : rows[s] + ranks[s]``."""

    y: torch.Tensor
    x: torch.Tensor
    As: list[torch.Tensor]
    Bs: list[torch.Tensor]
    scaling: torch.Tensor
    slots: torch.Tensor
    offsets: list[int]
    ranks: torch.Tensor
    rows: torch.Tensor
    max_rank: int

    def meta(self) -> LoRAMeta:
        return LoRAMeta.build(self.slots, self.scaling.shape[0])

    def weights(self) -> LoRAWeights:
        return LoRAWeights(self.As, self.Bs, self.scaling, self.offsets, ranks=self.ranks, rows=self.rows,
                           max_rank=self.max_rank)  # fmt: skip

    def _sum(self, magnitude: bool) -> torch.Tensor:
        """``y0 + scaling[s] * Bt[rows_s]^T @ (A[rows_s] @ x)`` per token in fp64, read from the pool
        rows alone (``magnitude``: the same over absolute values)."""
        f = torch.abs if magnitude else (lambda t: t)
        out = f(self.y.double()).clone()
        slots = self.slots.cpu()
        for slot, (first, rank) in enumerate(zip(self.rows.tolist(), self.ranks.tolist())):
            tokens = (slots == slot).nonzero().flatten().to(self.x.device)
            if rank == 0 or tokens.numel() == 0:
                continue
            x = f(self.x.double()[tokens])
            for A, Bt, offset in zip(self.As, self.Bs, self.offsets):
                a, bt = f(A.double()[first : first + rank]), f(Bt.double()[first : first + rank])
                delta = (x @ a.T) @ bt * f(self.scaling.double()[slot])
                out[tokens, offset : offset + Bt.shape[1]] += delta
        return out

    def exact(self) -> torch.Tensor:
        return self._sum(magnitude=False)

    def bound(self) -> torch.Tensor:
        return _bound(self._sum(magnitude=True), self.x, self.max_rank)


def pooled(
    case: Case,
    slot_ranks: list[int],
    *,
    seed: int = 0,
    gap: int | None = None,
    spare: int = 0,
    fill: float = float("nan"),
) -> PoolCase:
    """``case``'s adapters (slot ``s`` of rank ``slot_ranks[s]``) re-laid in row pools.

    The slots' rows go in a shuffled slot order, each followed by a gap of 0 to 5 rows (``gap``: that
    many rows after every slot instead), then ``spare`` free rows; rows that belong to no slot hold
    ``fill``, so that reading them shows. A rank-0 slot owns no rows (its ``rows`` entry still lies
    in the pool)."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(slot_ranks), generator=gen).tolist()
    firsts, row = [0] * len(slot_ranks), 0
    for slot in order:
        firsts[slot] = row
        row += slot_ranks[slot] + (gap if gap is not None else int(torch.randint(0, 6, (1,), generator=gen)))
    pool_rows, device = max(row + spare, 1), case.x.device
    As = [torch.full((pool_rows, A.shape[2]), fill, dtype=A.dtype, device=device) for A in case.As]
    Bs = [torch.full((pool_rows, B.shape[1]), fill, dtype=B.dtype, device=device) for B in case.Bs]
    for slot, (first, rank) in enumerate(zip(firsts, slot_ranks)):
        for A, B, A_pool, Bt_pool in zip(case.As, case.Bs, As, Bs):
            A_pool[first : first + rank] = A[slot, :rank]
            Bt_pool[first : first + rank] = B[slot, :, :rank].T
    i32 = dict(dtype=torch.int32, device=device)
    return PoolCase(case.y, case.x, As, Bs, case.scaling, case.slots, case.offsets, torch.tensor(slot_ranks, **i32),
                    torch.tensor(firsts, **i32), case.As[0].shape[1])  # fmt: skip


def with_pool_slots(case: PoolCase, slots: list[int]) -> PoolCase:
    """``case`` with its tokens' slots replaced (as many tokens as before)."""
    assert len(slots) == case.x.shape[0]
    return dataclasses.replace(case, slots=torch.tensor(slots, device=case.slots.device))


def triton_device(device: str) -> None:
    """Skip unless the Triton kernels can run on ``device`` in this process."""
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        return
    import kernels.triton_lora as triton_lora

    if not triton_lora.INTERPRETED:
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET unset: this machine has CUDA)")


def make_case(
    *,
    num_tokens: int,
    num_slots: int,
    rank: int,
    hidden: int,
    widths: list[int],
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    slot_ranks: list[int] | None = None,
    pass_ranks: bool = False,
    unused_slots: int = 1,
    no_adapter_fraction: float = 0.2,
    extra_columns: int = 0,
    seed: int = 0,
) -> Case:
    """A random step: tokens spread over all but ``unused_slots`` slots, some without an adapter.

    ``slot_ranks`` gives each slot its effective rank; A and B are zero beyond it (the engine's
    padding contract). ``extra_columns`` leaves untouched columns in ``y`` between and after slices.
    """
    gen = torch.Generator().manual_seed(seed)
    used = max(1, num_slots - unused_slots)
    slot_ids = torch.randperm(num_slots, generator=gen)[:used]
    slots = slot_ids[torch.randint(0, used, (num_tokens,), generator=gen)]
    no_adapter = torch.rand(num_tokens, generator=gen) < no_adapter_fraction
    slots = torch.where(no_adapter, torch.full_like(slots, -1), slots)
    ranks = slot_ranks if slot_ranks is not None else [rank] * num_slots
    keep = torch.arange(rank)[None, :] < torch.tensor(ranks)[:, None]  # [S, R]
    As, Bs, offsets, column = [], [], [], 0
    for width in widths:
        A = torch.randn(num_slots, rank, hidden, generator=gen) / hidden**0.5
        B = torch.randn(num_slots, width, rank, generator=gen) / rank**0.5
        As.append((A * keep[:, :, None]).to(dtype).to(device))
        Bs.append((B * keep[:, None, :]).to(dtype).to(device))
        offsets.append(column)
        column += width + extra_columns
    x_full = torch.randn(num_tokens, hidden + 3, generator=gen)
    x = x_full.to(dtype).to(device)[:, 1 : hidden + 1]  # a strided view, as a fused layer may pass
    y = torch.randn(num_tokens, column, generator=gen).to(dtype).to(device)
    scaling = (torch.rand(num_slots, generator=gen) * 2 + 0.25).to(device)
    rank_tensor = torch.tensor(ranks, dtype=torch.int32, device=device) if pass_ranks else None
    return Case(y, x, As, Bs, scaling, slots.to(device), offsets, rank_tensor)
