"""The torch reference of the multi-LoRA op: the oracle of the Triton kernels and the CPU path.

Numerics are the kernels' own, so the two agree up to fp32 summation order: the shrink
``h = x @ A[s, :r]^T`` accumulates in fp32; for bf16/fp16 inputs ``h`` is rounded to the input
dtype before the expand (as PEFT's own ``lora_B(lora_A(x))`` does in that dtype); the expand
``h @ B[s, :, :r]^T`` accumulates in fp32, is multiplied by ``scaling[s]`` in fp32, added to ``y``
in fp32 and rounded once to ``y``'s dtype.

Two strategies, same result. Small steps multiply every token by every slot's A in one GEMM, keep
each token's own slot (a 0/1 weight, times its scaling) and expand with one more GEMM against all
slots' B: a handful of ops whatever the number of adapters, which keeps a CPU decode step cheap
(torch's CPU bmm of many tiny matrices is slow, a GEMM is not). Large steps loop over the active
slots (never over tokens) and multiply each slot's token group at its own rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.meta import LoRAMeta

# Above this many multiply-adds per slice for the all-slots GEMMs (T * S * R * (K + N)), grouping by
# slot is cheaper. Measured on the 2-core development CPU (docs/kernels.md).
DENSE_MAX_MACS = 1 << 23


def lora_apply_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    As: Sequence[torch.Tensor],
    Bs: Sequence[torch.Tensor],
    scaling: torch.Tensor,
    meta: LoRAMeta,
    slice_offsets: Sequence[int],
    ranks: torch.Tensor | None,
) -> None:
    """Add every slice's LoRA output into its columns of ``y``, in place (arguments validated by
    :func:`kernels.lora_apply_sliced`)."""
    num_tokens = meta.num_tokens
    if num_tokens == 0:
        return
    num_slots, rank, hidden = As[0].shape
    dense_macs = num_tokens * num_slots * rank * (hidden + max(B.shape[1] for B in Bs))
    if dense_macs <= DENSE_MAX_MACS:
        _apply_dense(y, x, As, Bs, scaling, meta, slice_offsets)
    else:
        _apply_grouped(y, x, As, Bs, scaling, meta, slice_offsets, ranks)


def _hidden(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round the fp32 shrink output to the input dtype, as the kernels (and PEFT) do."""
    return h if dtype == torch.float32 else h.to(dtype).float()


def _add_into(y_cols: torch.Tensor, rows: torch.Tensor | None, delta: torch.Tensor) -> None:
    """``y_cols[rows] += delta`` with fp32 addition and one rounding to ``y``'s dtype."""
    if rows is None:
        if y_cols.dtype == torch.float32:
            y_cols.add_(delta)
        else:
            y_cols.copy_(y_cols.float() + delta)
        return
    if y_cols.dtype == torch.float32:
        y_cols.index_add_(0, rows, delta)
    else:
        y_cols.index_copy_(0, rows, (y_cols.index_select(0, rows).float() + delta).to(y_cols.dtype))


def _apply_dense(
    y: torch.Tensor,
    x: torch.Tensor,
    As: Sequence[torch.Tensor],
    Bs: Sequence[torch.Tensor],
    scaling: torch.Tensor,
    meta: LoRAMeta,
    slice_offsets: Sequence[int],
) -> None:
    """Every token against every slot in one GEMM per side, masked to the token's own slot.

    Padded rank rows and columns are read here, so they must hold zeros (the documented contract);
    a token without an adapter has an all-zero mask row and so gets an exact zero update.
    """
    num_tokens = meta.num_tokens
    num_slots, rank, hidden = As[0].shape
    slot_ids = torch.arange(num_slots, device=x.device)
    weight = (meta.token_slots[:num_tokens, None] == slot_ids).float() * scaling.float()  # [T, S]
    xf = x.float()
    for A, B, offset in zip(As, Bs, slice_offsets):
        h = _hidden(xf @ A.reshape(num_slots * rank, hidden).float().T, x.dtype)  # [T, S * R]
        h = (h.view(num_tokens, num_slots, rank) * weight.unsqueeze(-1)).view(num_tokens, num_slots * rank)
        delta = h @ B.float().transpose(1, 2).reshape(num_slots * rank, B.shape[1])
        _add_into(y[:, offset : offset + B.shape[1]], None, delta)


def _apply_grouped(
    y: torch.Tensor,
    x: torch.Tensor,
    As: Sequence[torch.Tensor],
    Bs: Sequence[torch.Tensor],
    scaling: torch.Tensor,
    meta: LoRAMeta,
    slice_offsets: Sequence[int],
    ranks: torch.Tensor | None,
) -> None:
    """A loop over active slots (not tokens): each slot's tokens at the slot's own rank."""
    order = meta.token_indices[: meta.num_tokens].long()
    scales = scaling.tolist()
    slot_ranks = ranks.tolist() if ranks is not None else None
    for slot, start, end in meta.host_groups():
        rank = slot_ranks[slot] if slot_ranks is not None else As[0].shape[1]
        if rank == 0:
            continue
        rows = order[start:end]
        xs = x.index_select(0, rows).float()
        for A, B, offset in zip(As, Bs, slice_offsets):
            h = _hidden(xs @ A[slot, :rank].float().T, x.dtype)
            delta = (h @ B[slot, :, :rank].float().T).mul_(scales[slot])
            _add_into(y[:, offset : offset + B.shape[1]], rows, delta)
