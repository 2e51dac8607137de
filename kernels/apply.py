"""Public multi-LoRA entry points: argument checks and the choice of backend.

Two layouts of a projection's adapter memory, both taken by :class:`LoRAWeights`:

- *slot tensors* (3-D): per slice ``A [S, R, K]`` and ``B [S, N, R]``; slot ``s`` is row ``s``, padded
  with zeros beyond its rank, so every slot costs ``R`` rows of memory;
- *row pool* (``rows=`` given): per slice ``A_pool [P, K]`` and ``Bt_pool [P, N]`` (B transposed, so an
  adapter's rows of ``B^T`` are contiguous); slot ``s`` owns pool rows ``rows[s] : rows[s] + ranks[s]``
  of every slice, so memory follows each adapter's own rank. Nothing outside a slot's rows is read.

``"triton"`` runs the Triton kernels (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``);
``"torch"`` runs the torch backend (``kernels/cpu_lora.py``); ``"auto"`` (the default) picks Triton
for CUDA tensors and the torch backend elsewhere. ``use_backend`` overrides the default for a block of code (tests run the
engine or the kernels through the interpreter that way); a ``backend=`` argument overrides both.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Literal

import torch

from kernels.cpu_lora import lora_apply_torch
from kernels.meta import LoRAMeta

Backend = Literal["auto", "torch", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")
MAX_SLICES = 3
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_backend: contextvars.ContextVar[str] = contextvars.ContextVar("kernels_backend", default="auto")


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[None]:
    """Run the multi-LoRA ops of this block with ``backend`` unless a call names its own."""
    _check_backend(backend)
    token = _backend.set(backend)
    try:
        yield
    finally:
        _backend.reset(token)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def resolve_backend(device: torch.device, backend: Backend | None = None) -> str:
    """The backend a call on ``device`` runs: ``"torch"`` or ``"triton"``."""
    chosen = backend if backend is not None else _backend.get()
    _check_backend(chosen)
    if chosen == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return chosen


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    scaling: torch.Tensor,
    meta: LoRAMeta,
    *,
    ranks: torch.Tensor | None = None,
    backend: Backend | None = None,
) -> None:
    """``y[t] += scaling[s_t] * B[s_t] @ (A[s_t] @ x[t])`` for every token ``t`` with slot
    ``s_t >= 0``, in place.

    ``y [T, N]``, ``x [T, K]``, ``A [S, R, K]``, ``B [S, N, R]`` of one dtype (fp32, bf16 or fp16),
    ``scaling [S]`` float, ``meta`` prepared for this step's ``T`` slots. ``ranks [S]`` (int32,
    optional): slot ``s`` uses only ``A[s, :ranks[s]]`` and ``B[s, :, :ranks[s]]`` and costs that
    rank in the kernels; the padded rest must be zero. Rank 0 skips the slot. On CPU ``ranks`` is
    range-checked; on CUDA checking would synchronise, so the kernels clamp it to ``R`` instead.
    """
    lora_apply_sliced(y, x, (A,), (B,), scaling, meta, slice_offsets=(0,), ranks=ranks, backend=backend)


def lora_apply_sliced(
    y: torch.Tensor,
    x: torch.Tensor,
    As: Sequence[torch.Tensor],
    Bs: Sequence[torch.Tensor],
    scaling: torch.Tensor,
    meta: LoRAMeta,
    slice_offsets: Sequence[int] | None = None,
    *,
    ranks: torch.Tensor | None = None,
    backend: Backend | None = None,
) -> None:
    """:func:`lora_apply` for a fused projection (q/k/v, gate/up) in one call.

    Slice ``i`` has its own ``As[i] [S, R, K]`` and ``Bs[i] [S, N_i, R]`` and adds into columns
    ``slice_offsets[i] : slice_offsets[i] + N_i`` of the packed ``y``; the default offsets pack the
    slices back to back from column 0. At most three slices; all share ``x``, ``scaling`` and
    ``ranks``.
    """
    lora_apply_weights(y, x, LoRAWeights(As, Bs, scaling, slice_offsets, ranks=ranks), meta, backend=backend)


class LoRAWeights:
    """One projection's adapter memory, validated once: slot tensors or a row pool.

    A layer whose adapter memory is fixed for its life (the engine's) builds this at set-up and
    calls :func:`lora_apply_weights` each step, which checks only what changes between calls
    (``x``, ``y``, ``meta``; on CPU also ``rows`` and ``ranks``): the full check costs more host time
    than both kernel launches. The tensors are written in place between calls (adapter loads);
    shapes never change.

    Slot tensors (``rows`` None): ``As[i] [S, R, K]``, ``Bs[i] [S, N_i, R]``, ``scaling [S]``,
    optional ``ranks [S]`` int32, as :func:`lora_apply_sliced` takes them.

    Row pool (``rows`` given): ``As[i] [P, K]`` and ``Bs[i] [P, N_i]`` (``B`` transposed: pool row
    ``j`` of ``Bs[i]`` is one column of an adapter's ``B``), ``rows [S]`` int32 the first pool row of
    each slot, ``ranks [S]`` int32 (required) its row count, ``max_rank`` (required) the largest
    rank a slot may have: the kernels' rank block and launch tables are sized for it. Slot ``s``
    reads pool rows ``rows[s] : rows[s] + ranks[s]`` of every slice (rank 0: the slot adds
    nothing). On CPU every call checks ``0 <= rows``, ``rows + ranks <= P`` and ``0 <= ranks <=
    max_rank``; on CUDA that would synchronise, so the kernels clamp instead (a slot's rank to
    ``max_rank`` and to the pool's end, a negative row to rank 0), never reading outside the pool.
    ``scaling``, ``ranks`` and ``rows`` live on the pools' device and may be rewritten in place
    between calls, also between replays of a captured CUDA graph.

    ``dora_scale`` (optional, ``[S + 1, N]`` in the weights' dtype, ``N`` at least every slice's
    last column): DoRA's per-output-column scale of each slot, row ``s + 1`` for slot ``s``. A
    token with slot ``s`` then gets ``y = (y + scaling[s] * B A x) * dora_scale[s + 1]`` over every
    slice's columns, in the expand kernel's epilogue (Triton) or after the adds (torch). The torch
    backend scales every token and column of ``y``, the kernels only a slot's tokens on its slices'
    columns, so the table must hold ones in row 0 (no adapter), in the rows of rank-0 slots and in
    columns outside the slices (serving.engine.layers.lora_linear keeps it so).

    Attributes the backends read: ``num_slots`` (S), ``rank`` (R, or ``max_rank`` for a pool),
    ``hidden`` (K), ``pool_rows`` (P; None for slot tensors), ``offsets`` (each slice's first column).
    """

    def __init__(
        self,
        As: Sequence[torch.Tensor],
        Bs: Sequence[torch.Tensor],
        scaling: torch.Tensor,
        slice_offsets: Sequence[int] | None = None,
        *,
        ranks: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        max_rank: int | None = None,
        dora_scale: torch.Tensor | None = None,
    ) -> None:
        self.As, self.Bs = tuple(As), tuple(Bs)
        self.scaling = scaling
        self.ranks = ranks
        self.rows = rows
        if rows is None:
            if max_rank is not None:
                raise TypeError("max_rank is the row pool's (pass rows with it); slot tensors take R from A")
            self.offsets = _check_weights(self.As, self.Bs, scaling, slice_offsets, ranks)
            A0 = self.As[0]
            self.num_slots, self.rank, self.hidden = A0.shape
            self.pool_rows: int | None = None
        else:
            self.offsets, self.rank = _check_pool(self.As, self.Bs, scaling, slice_offsets, ranks, rows, max_rank)
            self.num_slots = scaling.shape[0]
            self.pool_rows, self.hidden = self.As[0].shape
        A0 = self.As[0]
        self.dtype, self.device = A0.dtype, A0.device
        self.min_width = max(offset + B.shape[1] for offset, B in zip(self.offsets, self.Bs))
        if dora_scale is not None:
            want = f"[S + 1 = {self.num_slots + 1}, N >= {self.min_width}]"
            if dora_scale.dim() != 2 or dora_scale.shape[0] != self.num_slots + 1 or dora_scale.shape[1] < self.min_width:
                raise ValueError(f"dora_scale must be {want}, got {tuple(dora_scale.shape)}")
            if dora_scale.dtype != self.dtype or dora_scale.device != self.device:
                raise ValueError(f"dora_scale must be {self.dtype} on {self.device} like A, got {dora_scale.dtype} on "
                                 f"{dora_scale.device}")
            if dora_scale.stride(1) != 1:
                raise ValueError(f"dora_scale's rows must be contiguous, got strides {dora_scale.stride()}")
        self.dora_scale = dora_scale

    @property
    def pooled(self) -> bool:
        """True for the row-pool layout."""
        return self.rows is not None


def lora_apply_weights(
    y: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, meta: LoRAMeta, *, backend: Backend | None = None
) -> None:
    """:func:`lora_apply_sliced` with slot tensors validated once (:class:`LoRAWeights`)."""
    _check_call(y, x, weights, meta)
    w = weights
    if resolve_backend(x.device, backend) == "torch":
        lora_apply_torch(y, x, w.As, w.Bs, w.scaling, meta, w.offsets, w.ranks, w.rows, w.rank)
        if w.dora_scale is not None and meta.num_tokens:
            # One gather and one multiply after the adds; the table's ones leave the rest as it was.
            y[:, : w.dora_scale.shape[1]].mul_(w.dora_scale.index_select(0, meta.token_slots[: meta.num_tokens] + 1))
        return
    # Imported here: the Triton kernels are compiled (or, under TRITON_INTERPRET=1, interpreted)
    # according to the environment at import time, and CPU-only users never need them.
    from kernels.triton_lora import lora_apply_triton

    lora_apply_triton(y, x, w.As, w.Bs, w.scaling, meta, w.offsets, w.ranks, w.rows, w.rank, w.dora_scale)


def _check_call(y: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, meta: LoRAMeta) -> None:
    """What changes between calls: ``x``, ``y`` and ``meta`` against the weights (no synchronisation)."""
    if x.dim() != 2 or y.dim() != 2:
        raise ValueError(f"x and y must be 2-D [T, K] and [T, N], got {tuple(x.shape)} and {tuple(y.shape)}")
    num_tokens, hidden = x.shape
    if y.shape[0] != num_tokens:
        raise ValueError(f"x has {num_tokens} tokens but y has {y.shape[0]}")
    if meta.num_tokens != num_tokens:
        raise ValueError(f"meta was prepared for {meta.num_tokens} tokens, x has {num_tokens}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x must be one of {SUPPORTED_DTYPES}, got {x.dtype}")
    if meta.device != x.device:
        raise ValueError(f"meta is on {meta.device}, x on {x.device}")
    if weights.num_slots < meta.max_slots:
        raise ValueError(f"A has {weights.num_slots} slots but meta allows slot ids up to {meta.max_slots - 1}")
    if hidden != weights.hidden:
        expected = f"[P, K={hidden}]" if weights.pooled else f"[S={weights.num_slots}, R={weights.rank}, K={hidden}]"
        raise ValueError(f"A[0] must be {expected} for x's K={hidden}, got {tuple(weights.As[0].shape)}")
    for name, t in (("A", weights.As[0]), ("y", y)):
        if t.dtype != x.dtype:
            raise TypeError(f"{name} is {t.dtype} but x is {x.dtype}: all must share one dtype")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if weights.dora_scale is not None and weights.dora_scale.shape[1] > y.shape[1]:
        raise ValueError(f"dora_scale has {weights.dora_scale.shape[1]} columns, y only {y.shape[1]}")
    if weights.min_width > y.shape[1]:
        for i, (offset, B) in enumerate(zip(weights.offsets, weights.Bs)):
            if offset + B.shape[1] > y.shape[1]:
                raise ValueError(
                    f"slice {i} (columns {offset}..{offset + B.shape[1]}) does not fit y's {y.shape[1]} columns"
                )
    ranks = weights.ranks
    if ranks is None or ranks.device.type != "cpu":
        return
    if weights.rows is not None:
        assert weights.pool_rows is not None
        _check_pool_slots(weights.rows.tolist(), ranks.tolist(), weights.pool_rows, weights.rank)
    elif int(ranks.min()) < 0 or int(ranks.max()) > weights.rank:
        raise ValueError(f"ranks must lie in [0, {weights.rank}], got {ranks.tolist()}")


def _check_pool_slots(rows: list[int], ranks: list[int], pool_rows: int, max_rank: int) -> None:
    """Every slot's rows inside the pool and its rank in ``[0, max_rank]`` (host lists of a CPU call)."""
    for slot, (row, rank) in enumerate(zip(rows, ranks)):
        if not 0 <= rank <= max_rank:
            raise ValueError(f"ranks must lie in [0, max_rank={max_rank}], got ranks[{slot}] = {rank}")
        if row < 0:
            raise ValueError(f"rows must be >= 0, got rows[{slot}] = {row}")
        if row + rank > pool_rows:
            raise ValueError(
                f"slot {slot}'s pool rows {row}..{row + rank} (rows + ranks) pass the pool's P={pool_rows} rows"
            )


def _check_weights(
    As: tuple[torch.Tensor, ...],
    Bs: tuple[torch.Tensor, ...],
    scaling: torch.Tensor,
    slice_offsets: Sequence[int] | None,
    ranks: torch.Tensor | None,
) -> tuple[int, ...]:
    """Validate the slot tensors' shapes, dtypes and devices on the host; return the offsets."""
    if not 1 <= len(As) <= MAX_SLICES or len(As) != len(Bs):
        raise ValueError(f"need 1 to {MAX_SLICES} slices with as many A as B, got {len(As)} A and {len(Bs)} B")
    A0 = As[0]
    if A0.dim() != 3:
        raise ValueError(f"A must be [S, R, K] (or a row pool [P, K] with rows=), got shape {tuple(A0.shape)}")
    num_slots, rank, hidden = A0.shape
    for i, (A, B) in enumerate(zip(As, Bs)):
        if A.shape != (num_slots, rank, hidden):
            raise ValueError(f"A[{i}] must be [S={num_slots}, R={rank}, K={hidden}], got {tuple(A.shape)}")
        if B.dim() != 3 or B.shape[0] != num_slots or B.shape[2] != rank:
            raise ValueError(f"B[{i}] must be [S={num_slots}, N, R={rank}], got {tuple(B.shape)}")
        for name, t in ((f"A[{i}]", A), (f"B[{i}]", B)):
            if t.dtype != A0.dtype:
                raise TypeError(f"{name} is {t.dtype} but A[0] is {A0.dtype}: all must share one dtype")
            if t.device != A0.device:
                raise ValueError(f"{name} is on {t.device} but A[0] is on {A0.device}")
    if scaling.shape != (num_slots,) or not scaling.dtype.is_floating_point:
        raise ValueError(f"scaling must be a float tensor [S={num_slots}], got {scaling.dtype} {tuple(scaling.shape)}")
    if scaling.device != A0.device:
        raise ValueError(f"scaling is on {scaling.device} but A is on {A0.device}")
    if ranks is not None:
        if ranks.shape != (num_slots,) or ranks.dtype != torch.int32:
            raise ValueError(f"ranks must be an int32 tensor [S={num_slots}], got {ranks.dtype} {tuple(ranks.shape)}")
        if ranks.device != A0.device:
            raise ValueError(f"ranks is on {ranks.device} but A is on {A0.device}")
    return _offsets(Bs, slice_offsets)


def _check_pool(
    As: tuple[torch.Tensor, ...],
    Bs: tuple[torch.Tensor, ...],
    scaling: torch.Tensor,
    slice_offsets: Sequence[int] | None,
    ranks: torch.Tensor | None,
    rows: torch.Tensor,
    max_rank: int | None,
) -> tuple[tuple[int, ...], int]:
    """Validate a row pool's shapes, dtypes and devices on the host; return the offsets and max_rank."""
    if ranks is None:
        raise TypeError("the row pool needs ranks (int32 [S]): with rows given, each slot's row count")
    if max_rank is None:
        raise TypeError("the row pool needs max_rank (int): the kernels' rank block and the ranks' clamp")
    if isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1:
        raise ValueError(f"max_rank must be an int >= 1, got {max_rank!r}")
    if not 1 <= len(As) <= MAX_SLICES or len(As) != len(Bs):
        raise ValueError(f"need 1 to {MAX_SLICES} slices with as many A as B, got {len(As)} A and {len(Bs)} B")
    A0 = As[0]
    if A0.dim() != 2:
        raise ValueError(f"A pool must be [P, K] (rows given), got shape {tuple(A0.shape)}")
    pool_rows, hidden = A0.shape
    for i, (A, B) in enumerate(zip(As, Bs)):
        if A.shape != (pool_rows, hidden):
            raise ValueError(f"A[{i}] pool must be [P={pool_rows}, K={hidden}] like A[0], got {tuple(A.shape)}")
        if B.dim() != 2 or B.shape[0] != pool_rows:
            raise ValueError(f"B[{i}] pool must be [P={pool_rows}, N] (B transposed), got {tuple(B.shape)}")
        if B.stride(1) != 1:
            # The expand kernel reads a pool's rows as contiguous (a compile-time unit stride).
            raise ValueError(f"B[{i}] pool's rows must be contiguous (stride 1 along N), got strides {B.stride()}")
        for name, t in ((f"A[{i}]", A), (f"B[{i}]", B)):
            if t.dtype != A0.dtype:
                raise TypeError(f"{name} is {t.dtype} but A[0] is {A0.dtype}: all must share one dtype")
            if t.device != A0.device:
                raise ValueError(f"{name} is on {t.device} but A[0] is on {A0.device}")
    if scaling.dim() != 1 or not scaling.dtype.is_floating_point:
        raise ValueError(f"scaling must be a float tensor [S], got {scaling.dtype} {tuple(scaling.shape)}")
    num_slots = scaling.shape[0]
    for name, t in (("ranks", ranks), ("rows", rows)):
        if t.shape != (num_slots,) or t.dtype != torch.int32:
            raise ValueError(
                f"{name} must be an int32 tensor [S={num_slots}] (scaling's S), got {t.dtype} {tuple(t.shape)}"
            )
    for name, t in (("scaling", scaling), ("ranks", ranks), ("rows", rows)):
        if t.device != A0.device:
            raise ValueError(f"{name} is on {t.device} but the A pool is on {A0.device}")
    return _offsets(Bs, slice_offsets), max_rank


def _offsets(Bs: tuple[torch.Tensor, ...], slice_offsets: Sequence[int] | None) -> tuple[int, ...]:
    """Each slice's first column in ``y``: given, or back to back from 0; never overlapping."""
    widths = [B.shape[1] for B in Bs]
    if slice_offsets is None:
        offsets = [sum(widths[:i]) for i in range(len(widths))]
    else:
        offsets = [int(o) for o in slice_offsets]
        if len(offsets) != len(Bs):
            raise ValueError(f"{len(Bs)} slices but {len(offsets)} slice_offsets")
    for i, offset in enumerate(offsets):
        if offset < 0:
            raise ValueError(f"slice {i} has a negative offset {offset}")
    spans = sorted(zip(offsets, widths))
    for (offset, width), (next_offset, _) in zip(spans, spans[1:]):
        if offset + width > next_offset:
            raise ValueError(f"slices overlap: columns {offset}..{offset + width} and from {next_offset}")
    return tuple(offsets)
