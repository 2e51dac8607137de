"""Paged-attention decode in Triton: one query token per sequence attends to its context where the
KV cache holds it, through the sequence's block table, with no gather of the pages.

A program owns one sequence, one KV head and one share of the context. It loads the query rows of
every query head of the KV head's group at once (grouped-query attention: the group's heads share
each K/V load, so K and V are read once per KV head, not once per query head), walks the context
``BLOCK_N`` tokens at a time (each token's page looked up in the block table, so any page size
works) with an online softmax in fp32, and writes the normalised output. For short batches the
context is split over ``num_splits`` programs per (sequence, head) (flash-decoding): each writes
its running max, sum and unnormalised output, and a second kernel combines them.

Shapes are fixed by the batch size and the block table's width alone, never by the contexts'
lengths (read on the device), so a CUDA graph replays it for any mix of lengths.

A flat step (``row_seq`` given) also carries prompt chunks: *runs* of consecutive rows of one
sequence. Through the decode kernel each such row would read its whole prefix alone (a 512-token
prompt reads its keys 512 times, about 21 TFLOP/s on an H100). So the decode kernel leaves runs out
and ``_runs_kernel`` serves them as tiled causal attention: a program owns ``BLOCK_Q`` consecutive
rows and one KV head, and multiplies all the rows' query heads of the group (``BLOCK_Q * BLOCK_G``
query rows, the tensor cores' M) against each key block once. Which rows form runs is found on the
device from ``row_seq`` (a row is in a run when a neighbour names its sequence), so the launch's
shape is still the row count's alone and a graph captures both launches; a tile with no run in it
does nothing.

The cache layout is the engine's: ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer
for K and for V; token ``i`` of a sequence sits in page ``block_table[i // block_size]`` at row
``i % block_size``. With a sliding window ``w``, a query at position ``L - 1`` sees the last ``w``
tokens (positions ``L - w .. L - 1``), as Mistral and transformers compute it. With a soft-cap
``c`` (Gemma 2) each scaled score ``s`` becomes ``c * tanh(s / c)`` before the softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels.jit import jit

# (sequence, KV head) programs below which the context is split: about two programs per SM of an H200.
_SPLIT_BELOW_PROGRAMS = 264
MAX_SPLITS = 16
# The decode kernel's warps and pipeline stages.
DECODE_WARPS = 4
DECODE_STAGES = 2
# Query rows (tokens x the group's heads) a program of _runs_kernel multiplies at once: the M of
# its dots, 128 as flash attention's forward tiles on Hopper (a quarter under the interpreter).
RUN_TILE_ROWS = 128
# _runs_kernel's key block, warps and pipeline stages.
RUN_BLOCK_N = 64
RUN_WARPS = 8
RUN_STAGES = 2


@jit
def _dot(a: tl.tensor, b: tl.tensor, acc: tl.tensor, PRECISION: tl.constexpr, UPCAST: tl.constexpr) -> tl.tensor:
    """``acc + a @ b`` in fp32; under the interpreter bf16 tiles are upcast (it multiplies bf16 as
    raw bits), which is exact: products of bf16 values fit fp32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@jit
def _block_slots(table: tl.tensor, offs_n: tl.tensor, n_mask: tl.tensor, PAGE: tl.constexpr) -> tl.tensor:
    """The cache slots of a sequence's tokens ``offs_n``, each looked up in its page table ``table``."""
    page = tl.load(table + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
    return page * PAGE + offs_n % PAGE


@jit
def _cap(scores: tl.tensor, softcap: tl.tensor) -> tl.tensor:
    """``c * tanh(s / c)``, as ``tanh(x) = 1 - 2 / (exp(2x) + 1)``: exact at both ends (exp → inf or 0)."""
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))


@jit
def _in_run(row_seq_ptr: tl.tensor, rows: tl.tensor, num_rows: tl.tensor) -> tl.tensor:
    """1 where row ``rows`` shares its sequence with a neighbouring row (it is in a run: a prompt
    chunk of two or more tokens), else 0; ``rows`` a scalar or a vector of row indices."""
    row_ok = rows < num_rows
    seq = tl.load(row_seq_ptr + rows, mask=row_ok, other=-1)
    prev = tl.load(row_seq_ptr + rows - 1, mask=row_ok & (rows > 0), other=-2)
    nxt = tl.load(row_seq_ptr + rows + 1, mask=rows + 1 < num_rows, other=-3)
    return (row_ok & ((prev == seq) | (nxt == seq))).to(tl.int32)


@jit
def _runs_kernel(
    q_ptr: tl.tensor, k_ptr: tl.tensor, v_ptr: tl.tensor, tables_ptr: tl.tensor, row_seq_ptr: tl.tensor,
    lens_ptr: tl.tensor, out_ptr: tl.tensor,
    num_rows: tl.tensor, scale: tl.tensor, window: tl.tensor, softcap: tl.tensor,
    stride_qb: tl.tensor, stride_qh: tl.tensor, stride_kslot: tl.tensor, stride_kh: tl.tensor,
    stride_vslot: tl.tensor, stride_vh: tl.tensor, stride_tb: tl.tensor, stride_ob: tl.tensor, stride_oh: tl.tensor,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr,
) -> None:  # fmt: skip
    """Causal attention of the run rows among ``BLOCK_Q`` consecutive rows, for one KV head.

    Query row ``m`` of the tile is row ``tile * BLOCK_Q + m // BLOCK_G``, head ``m % BLOCK_G`` of
    the group. A tile may hold the end of one run and the start of the next (or decode rows, left
    out): each run is one pass over its sequence's keys, with the other rows' scores masked, so the
    running max, sum and output of every row are those of its own run's pass alone."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
    offs_m = tl.arange(0, BLOCK_M)
    m_row = offs_m // BLOCK_G
    m_head = offs_m % BLOCK_G
    rows = tile * BLOCK_Q + m_row
    row_ok = rows < num_rows
    in_run = _in_run(row_seq_ptr, rows, num_rows) != 0
    row_seq = tl.load(row_seq_ptr + rows, mask=row_ok, other=-1)
    prev = tl.load(row_seq_ptr + rows - 1, mask=row_ok & (rows > 0), other=-2)
    # A run's first row in this tile, counted on head 0 of the row (which comes first of its heads).
    starts = in_run & (m_head == 0) & ((m_row == 0) | (prev != row_seq))
    run_of = tl.cumsum(starts.to(tl.int32), axis=0)  # a row's run, 1-based, where in_run
    num_runs = tl.sum(starts.to(tl.int32), axis=0)

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_live = in_run & (m_head < GROUP)
    heads = kv_head * GROUP + m_head
    q = tl.load(
        q_ptr + rows[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=m_live[:, None] & d_mask[None, :], other=0.0,
    )  # fmt: skip
    length = tl.load(lens_ptr + rows, mask=row_ok, other=1).to(tl.int32)
    low = tl.where(window > 0, tl.maximum(length - window, 0), 0)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for run in range(1, num_runs + 1):
        mine = m_live & (run_of == run)
        seq = tl.max(tl.where(mine, row_seq, -1), axis=0)
        table = tables_ptr + seq.to(tl.int64) * stride_tb
        first = tl.min(tl.where(mine, low, 2147483647), axis=0) // BLOCK_N * BLOCK_N
        last = tl.max(tl.where(mine, length, 0), axis=0)
        for n0 in range(first, last, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < last
            slot = _block_slots(table, offs_n, n_mask, PAGE)
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + slot[:, None] * stride_kslot + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
            scores = _dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), PRECISION, UPCAST) * scale
            if SOFTCAP:
                scores = _cap(scores, softcap)
            seen = mine[:, None] & (offs_n[None, :] < length[:, None]) & (offs_n[None, :] >= low[:, None])
            scores = tl.where(seen, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            # A row with no key seen yet (another run's, or before its window) keeps m = -inf: exp
            # against 0 instead keeps its p and alpha at 0 rather than NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + slot[:, None] * stride_vslot + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
            acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, UPCAST)
            m_i = m_new
    out = acc / tl.where(m_live, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=m_live[:, None] & d_mask[None, :],
    )  # fmt: skip


@jit
def _decode_kernel(
    q_ptr: tl.tensor, k_ptr: tl.tensor, v_ptr: tl.tensor, tables_ptr: tl.tensor, row_seq_ptr: tl.tensor,
    lens_ptr: tl.tensor, out_ptr: tl.tensor, part_m_ptr: tl.tensor, part_l_ptr: tl.tensor,
    part_acc_ptr: tl.tensor,
    num_rows: tl.tensor, scale: tl.tensor, window: tl.tensor, softcap: tl.tensor,
    stride_qb: tl.tensor, stride_qh: tl.tensor, stride_kslot: tl.tensor, stride_kh: tl.tensor,
    stride_vslot: tl.tensor, stride_vh: tl.tensor, stride_tb: tl.tensor, stride_ob: tl.tensor, stride_oh: tl.tensor,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    ROW_SEQ: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr,
) -> None:  # fmt: skip
    seq = tl.program_id(0)  # the query row (one token)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + seq).to(tl.int32)
    low = tl.where(window > 0, tl.maximum(length - window, 0), 0)
    # This program's share of [low, length), in whole BLOCK_N steps.
    per_split = tl.cdiv(tl.cdiv(length - low, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = low + split * per_split
    end = tl.minimum(start + per_split, length)
    live = 1
    if ROW_SEQ:
        # A row of a run is _runs_kernel's: this program reads nothing and writes nothing (no head
        # of the group is live; a mask of the vector alone, as the interpreter wants it).
        live = 1 - _in_run(row_seq_ptr, seq, num_rows)
        end = tl.where(live != 0, end, start)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP * live
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )  # fmt: skip
    m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    if ROW_SEQ:
        table = tables_ptr + tl.load(row_seq_ptr + seq).to(tl.int64) * stride_tb
    else:
        table = tables_ptr + seq.to(tl.int64) * stride_tb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        slot = _block_slots(table, offs_n, n_mask, PAGE)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_kslot + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        scores = _dot(q, tl.trans(k), tl.zeros((BLOCK_G, BLOCK_N), dtype=tl.float32), PRECISION, UPCAST) * scale
        if SOFTCAP:
            scores = _cap(scores, softcap)
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + slot[:, None] * stride_vslot + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, UPCAST)
        m = m_new

    if NUM_SPLITS == 1:
        out = acc / l[:, None]
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :],
        )  # fmt: skip
    else:
        # Partials laid out [seq, kv_head, split, BLOCK_G(, BLOCK_D)], contiguous.
        row = (seq * tl.num_programs(1) + kv_head) * NUM_SPLITS + split
        tl.store(part_m_ptr + row * BLOCK_G + offs_g, m)
        tl.store(part_l_ptr + row * BLOCK_G + offs_g, l)
        tl.store(part_acc_ptr + (row * BLOCK_G + offs_g[:, None]) * BLOCK_D + offs_d[None, :], acc)


@jit
def _combine_kernel(
    part_m_ptr: tl.tensor, part_l_ptr: tl.tensor, part_acc_ptr: tl.tensor, out_ptr: tl.tensor,
    row_seq_ptr: tl.tensor, num_rows: tl.tensor, stride_ob: tl.tensor, stride_oh: tl.tensor,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, ROW_SEQ: tl.constexpr,
) -> None:  # fmt: skip
    """Weigh each split's partial output by ``exp(m_split - m_max)`` and normalise by the weighed
    sums (rows of runs are left to ``_runs_kernel``)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    rows = (seq * tl.num_programs(1) + kv_head) * NUM_SPLITS + offs_s
    ml = rows[:, None] * BLOCK_G + offs_g[None, :]  # [S, G]
    m = tl.load(part_m_ptr + ml)
    l = tl.load(part_l_ptr + ml)
    m_max = tl.max(m, axis=0)  # [G]; every sequence has >= 1 token, so some split saw one
    weight = tl.exp(m - m_max[None, :])  # an empty split (m = -inf) weighs 0
    total = tl.sum(l * weight, axis=0)
    acc = tl.load(part_acc_ptr + ml[:, :, None] * BLOCK_D + offs_d[None, None, :])  # [S, G, D]
    out = tl.sum(acc * weight[:, :, None], axis=0) / total[:, None]
    heads = kv_head * GROUP + offs_g
    live = 1
    if ROW_SEQ:
        live = 1 - _in_run(row_seq_ptr, seq, num_rows)
    tl.store(
        out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=(offs_g < GROUP * live)[:, None] & (offs_d < HEAD_DIM)[None, :],
    )  # fmt: skip


# Under TRITON_INTERPRET=1 (CPU tests) the kernels are interpreted and bf16 dots need the upcast.
INTERPRETED = isinstance(_decode_kernel, InterpretedFunction)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def decode_splits(batch: int, num_kv_heads: int, max_context: int, block_n: int = 64) -> int:
    """How many programs share one sequence's context: enough that the grid fills the chip, never
    more than the longest context has ``block_n`` steps (a power of two, at most ``MAX_SPLITS``)."""
    splits = 1
    while batch * num_kv_heads * splits < _SPLIT_BELOW_PROGRAMS and splits < MAX_SPLITS:
        splits *= 2
    while splits > 1 and (splits // 2) * block_n >= max_context:
        splits //= 2
    return splits


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int = 1,
    block_n: int = 64,
    out: torch.Tensor | None = None,
    row_seq: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``q [B, H, D]`` (one token per sequence, at position ``context_lens[b] - 1``, its own K/V
    already in the cache) → ``[B, H, D]`` attention over ``context_lens[b]`` cached tokens.

    ``k_cache``/``v_cache [num_blocks, block_size, Hkv, D]``; ``block_tables [B, W]`` int (page
    ids; entries past a sequence's pages are never read); ``context_lens [B]`` int, each >= 1.
    ``H`` must be a multiple of ``Hkv``. No host synchronisation: graph-capturable.

    ``row_seq [B]`` int, if given: row ``b`` reads block table ``row_seq[b]`` (``block_tables`` is
    then per sequence, any number of rows). Tokens of one prompt chunk are then rows of their own,
    each at its position with ``context_lens[b] = position + 1``: causal attention over the cached
    prefix and the chunk's own keys, as a prefill computes it. Rows next to a row of their own
    sequence (a chunk's) are served by ``_runs_kernel``, a second launch, the others (decodes) here.

    ``softcap``, if given, caps every scaled score at ``softcap * tanh(score / softcap)``.
    """
    batch, num_heads, head_dim = q.shape
    num_blocks, page, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q has head_dim {head_dim}; caches are {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if (block_tables.shape[0] != batch and row_seq is None) or context_lens.shape != (batch,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} must cover {batch} sequences"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the caches must be contiguous in head_dim")
    if k_cache.stride(0) != page * k_cache.stride(1) or v_cache.stride(0) != page * v_cache.stride(1):
        raise ValueError("each cache's pages must be contiguous rows (stride(0) == block_size * stride(1))")
    if row_seq is not None and row_seq.shape != (batch,):
        raise ValueError(f"row_seq {tuple(row_seq.shape)} must have one entry per query row ({batch})")
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if not 1 <= num_splits <= MAX_SPLITS or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two in [1, {MAX_SPLITS}], got {num_splits}")
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    block_g = max(16, _next_pow2(group))
    block_d = max(16, _next_pow2(head_dim))
    block_n = max(16, block_n)
    if q.dtype == torch.float32:
        precision, upcast = "ieee", False
    else:
        precision, upcast = "tf32", INTERPRETED
    if num_splits > 1:
        rows = batch * num_kv_heads * num_splits
        part_m = torch.empty((rows, block_g), dtype=torch.float32, device=q.device)
        part_l = torch.empty((rows, block_g), dtype=torch.float32, device=q.device)
        part_acc = torch.empty((rows, block_g, block_d), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens if row_seq is None else row_seq, context_lens, out,
        part_m, part_l, part_acc, batch, scale, sliding_window or 0, softcap or 1.0,
        q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=page, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, ROW_SEQ=row_seq is not None, PRECISION=precision, UPCAST=upcast,
        SOFTCAP=softcap is not None, num_warps=DECODE_WARPS, num_stages=DECODE_STAGES,
    )  # fmt: skip
    if num_splits > 1:
        _combine_kernel[(batch, num_kv_heads)](
            part_m, part_l, part_acc, out, context_lens if row_seq is None else row_seq, batch,
            out.stride(0), out.stride(1),
            GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
            ROW_SEQ=row_seq is not None, num_warps=4,
        )  # fmt: skip
    if row_seq is not None:
        # The runs' rows (prompt chunks), which the launches above left out.
        run_g = _next_pow2(group)
        block_q = max(1, (RUN_TILE_ROWS // 4 if INTERPRETED else RUN_TILE_ROWS) // run_g)
        _runs_kernel[(triton.cdiv(batch, block_q), num_kv_heads)](
            q, k_cache, v_cache, block_tables, row_seq, context_lens, out,
            batch, scale, sliding_window or 0, softcap or 1.0,
            q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1),
            GROUP=group, BLOCK_G=run_g, BLOCK_Q=block_q, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=page,
            BLOCK_N=RUN_BLOCK_N, PRECISION=precision, UPCAST=upcast, SOFTCAP=softcap is not None,
            num_warps=RUN_WARPS, num_stages=RUN_STAGES,
        )  # fmt: skip
    return out
