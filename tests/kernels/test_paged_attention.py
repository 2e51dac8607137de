"""The paged-attention decode kernel against attention computed in fp64 over each sequence's
gathered context: interpreted on CPU, compiled on CUDA (gpu mark).

Every case scatters each sequence's pages over a shuffled cache (so a wrong page lookup shows),
poisons the output first (so an unwritten row shows), and varies page size, GQA ratio, head dim,
sliding window and the context split.
"""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import decode_splits, paged_decode_attention

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _device(device: str) -> None:
    if device == "cuda":
        if not CUDA:
            pytest.skip("needs a CUDA device")
        return
    import kernels.paged_attention as paged

    if not paged.INTERPRETED:
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET unset: this machine has CUDA)")


def _reference(q, k_cache, v_cache, tables, lens, scale, window, softcap=None):
    """fp64 attention of each sequence's one query over its own gathered context."""
    out = torch.empty(q.shape, dtype=torch.float64)
    page = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    for b, length in enumerate(lens.tolist()):
        positions = torch.arange(length)
        slots = tables[b, positions // page].cpu() * page + positions % page
        keys = k_cache.flatten(0, 1)[slots.to(k_cache.device)].double().cpu()  # [L, Hkv, D]
        values = v_cache.flatten(0, 1)[slots.to(k_cache.device)].double().cpu()
        if window is not None:
            keys, values = keys[-window:], values[-window:]
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].double().cpu(), keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values)
    return out


CASES = {
    # name: (batch, heads, kv_heads, head_dim, page, lens, window, splits, dtype)
    "gqa4-page16": (3, 8, 2, 32, 16, [1, 17, 70], None, 1, torch.float32),
    "mha-page4": (2, 4, 4, 16, 4, [5, 33], None, 1, torch.float32),
    "gqa8-split4-bf16": (2, 16, 2, 64, 8, [3, 150], None, 4, torch.bfloat16),
    "window": (3, 4, 2, 16, 4, [2, 9, 40], 7, 1, torch.float32),
    "window-split": (2, 4, 1, 16, 16, [100, 31], 50, 2, torch.float16),
    "head-dim-80": (2, 6, 3, 80, 16, [20, 64], None, 1, torch.float32),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.slow
def test_decode_matches_reference(device: str, name: str) -> None:
    _device(device)
    batch, heads, kv_heads, head_dim, page, lens, window, splits, dtype = CASES[name]
    generator = torch.Generator().manual_seed(hash(name) % 2**31)
    widest = max(-(-n // page) for n in lens) + 1  # one unused column beyond the longest table
    num_blocks = batch * widest + 3
    k_cache = torch.randn(num_blocks, page, kv_heads, head_dim, generator=generator).to(device=device, dtype=dtype)
    v_cache = torch.randn(num_blocks, page, kv_heads, head_dim, generator=generator).to(device=device, dtype=dtype)
    pages = torch.randperm(num_blocks, generator=generator)
    tables = pages[: batch * widest].view(batch, widest).to(device)
    lens_t = torch.tensor(lens, device=device)
    q = torch.randn(batch, heads, head_dim, generator=generator).to(device=device, dtype=dtype)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(
        q, k_cache, v_cache, tables, lens_t, scale=scale, sliding_window=window, num_splits=splits, out=out
    )
    ref = _reference(q, k_cache, v_cache, tables, lens_t, scale, window)
    assert not out.isnan().any(), "every output element must be written"
    error = (out.double().cpu() - ref).norm() / ref.norm()
    assert error < (2e-6 if dtype == torch.float32 else 1e-2), f"relative error {error:.2e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.slow
def test_flat_rows_attend_causally(device: str, window: int | None) -> None:
    """A flat step: a prompt chunk's tokens (after a cached prefix), a whole prompt and a decode,
    each token a row naming its sequence's table through ``row_seq`` with ``context_lens`` =
    position + 1: each row attends to its own prefix, as causal prefill attention does."""
    _device(device)
    generator = torch.Generator().manual_seed(11 + (window or 0))
    page, kv_heads, heads, head_dim = 4, 2, 8, 16
    k_cache = torch.randn(30, page, kv_heads, head_dim, generator=generator).to(device)
    v_cache = torch.randn(30, page, kv_heads, head_dim, generator=generator).to(device)
    tables = torch.randperm(30, generator=generator)[:24].view(3, 8).to(device)  # per sequence
    # sequence 0: positions 9..20 (a chunk after 9 cached tokens); 1: 0..6 (a whole prompt); 2: decode at 25
    rows = [(0, p) for p in range(9, 21)] + [(1, p) for p in range(7)] + [(2, 25)]
    row_seq = torch.tensor([s for s, _ in rows], device=device)
    lens = torch.tensor([p + 1 for _, p in rows], device=device)
    q = torch.randn(len(rows), heads, head_dim, generator=generator).to(device)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, tables, lens, scale=0.25, sliding_window=window, out=out, row_seq=row_seq)
    ref = _reference(q, k_cache, v_cache, tables[row_seq], lens, 0.25, window)
    assert not out.isnan().any(), "every output element must be written"
    assert (out.double().cpu() - ref).norm() / ref.norm() < 2e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("window", "splits"), [(None, 1), (6, 2)])
def test_soft_capped_scores_match_reference(device: str, window: int | None, splits: int) -> None:
    """Gemma 2's cap: scores scaled large enough that the cap bites (uncapped attention differs)."""
    _device(device)
    generator = torch.Generator().manual_seed(5)
    k_cache = torch.randn(12, 4, 2, 16, generator=generator).to(device)
    v_cache = torch.randn(12, 4, 2, 16, generator=generator).to(device)
    tables = torch.randperm(12, generator=generator)[:10].view(2, 5).to(device)
    lens = torch.tensor([19, 7], device=device)
    q = torch.randn(2, 4, 16, generator=generator).to(device)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale=2.0, sliding_window=window,
                                 num_splits=splits, softcap=3.0)  # fmt: skip
    ref = _reference(q, k_cache, v_cache, tables, lens, 2.0, window, softcap=3.0)
    uncapped = _reference(q, k_cache, v_cache, tables, lens, 2.0, window)
    assert (out.double().cpu() - ref).norm() / ref.norm() < 2e-6
    assert (uncapped - ref).norm() / ref.norm() > 0.1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_splits_agree(device: str) -> None:
    """Splitting the context changes the order of the sum only."""
    _device(device)
    generator = torch.Generator().manual_seed(7)
    k_cache = torch.randn(20, 16, 2, 32, generator=generator).to(device)
    v_cache = torch.randn(20, 16, 2, 32, generator=generator).to(device)
    tables = torch.randperm(20, generator=generator)[:18].view(2, 9).to(device)
    lens = torch.tensor([140, 9], device=device)
    q = torch.randn(2, 4, 32, generator=generator).to(device)
    outs = [paged_decode_attention(q, k_cache, v_cache, tables, lens, scale=0.2, num_splits=s) for s in (1, 2, 8)]
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], rtol=1e-5, atol=1e-6)


def test_bad_shapes_are_refused() -> None:
    q = torch.zeros(2, 6, 16)
    cache = torch.zeros(4, 4, 4, 16)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(q, cache, cache, torch.zeros(2, 2, dtype=torch.long), torch.ones(2), scale=1.0)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(
            torch.zeros(2, 8, 16), cache, cache, torch.zeros(2, 2, dtype=torch.long), torch.ones(2), scale=1.0, num_splits=3
        )


def test_decode_splits() -> None:
    assert decode_splits(64, 8, 512) == 1  # 512 programs already fill the chip
    assert decode_splits(1, 8, 4096) == 16
    assert decode_splits(1, 8, 100) == 2  # no more splits than 64-token steps
    assert decode_splits(2, 8, 10) == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("window", "splits", "softcap", "heads", "head_dim"), [(None, 1, None, 8, 16), (6, 2, 2.5, 6, 20)]
)
@pytest.mark.slow
def test_runs_in_tiles_attend_causally(
    device: str, window: int | None, splits: int, softcap: float | None, heads: int, head_dim: int
) -> None:
    """Runs (prompt chunks) that start and end inside tiles and cross a tile's edge, between decode
    rows and padding rows of one scratch sequence, as a flat step's graph lays them out: every row
    equals its own sequence's causal attention, and no row is written twice wrong or left unwritten.
    The second case's group of 3 heads and head_dim of 20 leave padding in both tile dimensions."""
    _device(device)
    generator = torch.Generator().manual_seed(23 + splits)
    page, kv_heads = 4, 2
    k_cache = torch.randn(60, page, kv_heads, head_dim, generator=generator).to(device)
    v_cache = torch.randn(60, page, kv_heads, head_dim, generator=generator).to(device)
    tables = torch.randperm(60, generator=generator)[:55].view(5, 11).to(device)
    # decodes of sequences 0 and 1; a 2-token chunk of 2 after 3 cached; 3's whole 37-token prompt
    # (it crosses the interpreter's 8-row tiles); a decode of 4 at 40; three padding rows (sequence 4's
    # table stands in for the scratch one) at position 0.
    rows = [(0, 17), (1, 3)] + [(2, p) for p in (3, 4)] + [(3, p) for p in range(37)] + [(4, 40)]
    rows += [(4, 0)] * 3
    row_seq = torch.tensor([s for s, _ in rows], device=device)
    lens = torch.tensor([p + 1 for _, p in rows], device=device)
    q = torch.randn(len(rows), heads, head_dim, generator=generator).to(device)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, tables, lens, scale=0.3, sliding_window=window, out=out,
                           row_seq=row_seq, num_splits=splits, softcap=softcap)  # fmt: skip
    ref = _reference(q, k_cache, v_cache, tables[row_seq], lens, 0.3, window, softcap=softcap)
    assert not out.isnan().any(), "every output element must be written"
    errors = (out.double().cpu() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
    assert errors.max() < 2e-6, f"rows off: {(errors >= 2e-6).nonzero().flatten().tolist()}"
