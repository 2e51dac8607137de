"""The Triton kernels against the torch reference: interpreted on CPU, compiled on CUDA (gpu mark)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lora_cases import Case, make_case, triton_device

from kernels import LoRAMeta, lora_apply, lora_apply_sliced


def _check(case: Case) -> None:
    """Triton, the reference and the exact result agree within the case's error bound."""
    meta = case.meta()
    y_triton, y_torch = case.y.clone(), case.y.clone()
    args = (case.x, case.As, case.Bs, case.scaling, meta, case.offsets)
    lora_apply_sliced(y_triton, *args, ranks=case.ranks, backend="triton")
    lora_apply_sliced(y_torch, *args, ranks=case.ranks, backend="torch")
    bound = case.bound().to(y_triton.device)
    diff = (y_triton.double() - y_torch.double()).abs()
    worst = (diff / bound).max().item()
    assert worst <= 1.0, f"Triton vs reference: {worst:.2f}x the error bound"
    exact_diff = (y_triton.double() - case.exact().to(y_triton.device)).abs()
    assert (exact_diff <= bound).all(), f"Triton vs exact: {(exact_diff / bound).max().item():.2f}x the bound"
    untouched = torch.ones(case.y.shape[1], dtype=torch.bool)
    for B, offset in zip(case.Bs, case.offsets):
        untouched[offset : offset + B.shape[1]] = False
    no_adapter = (case.slots < 0).cpu()
    assert torch.equal(y_triton[:, untouched.to(y_triton.device)], case.y[:, untouched.to(case.y.device)])
    assert torch.equal(y_triton[no_adapter.to(case.y.device)], case.y[no_adapter.to(case.y.device)])


CASES = {
    "one-token": dict(num_tokens=1, num_slots=1, rank=16, hidden=64, widths=[64], unused_slots=0,
                      no_adapter_fraction=0.0),
    "uneven-K-mixed-ranks": dict(num_tokens=7, num_slots=4, rank=16, hidden=96, widths=[48],
                                 slot_ranks=[8, 16, 16, 0], pass_ranks=True),
    "qkv-gqa-bf16": dict(num_tokens=33, num_slots=16, rank=64, hidden=128, widths=[64, 16, 16],
                         dtype=torch.bfloat16, slot_ranks=[8, 16, 64, 16] * 4, pass_ranks=True, unused_slots=5),
    "gate-up-fp16-gaps": dict(num_tokens=200, num_slots=16, rank=16, hidden=256, widths=[64, 64],
                              dtype=torch.float16, extra_columns=8, unused_slots=3),
    "prefill-bf16": dict(num_tokens=600, num_slots=8, rank=16, hidden=128, widths=[128], dtype=torch.bfloat16),
    "rank-128": dict(num_tokens=20, num_slots=3, rank=128, hidden=64, widths=[32], slot_ranks=[128, 16, 70],
                     pass_ranks=True, unused_slots=0),
    "rank-256": dict(num_tokens=5, num_slots=2, rank=256, hidden=32, widths=[16], slot_ranks=[256, 40],
                     pass_ranks=True, unused_slots=0, no_adapter_fraction=0.0),
    "padded-ranks-unpassed-fp32": dict(num_tokens=50, num_slots=6, rank=64, hidden=64, widths=[32, 32, 16],
                                       slot_ranks=[8, 16, 64, 8, 16, 64]),
    "all-base": dict(num_tokens=9, num_slots=2, rank=16, hidden=32, widths=[16], no_adapter_fraction=1.0),
    # A serving step's layout past 256 tokens (decode tables, kernels.triton_lora.DECODE_MAX_TOKENS):
    # 264, the interpreter's cost being per 16-row tile; the same configs as at 400 (hidden 128: no split-K).
    "mixed-264-bf16": dict(num_tokens=264, num_slots=16, rank=16, hidden=128, widths=[64, 32], dtype=torch.bfloat16),
}

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_triton_matches_reference(name: str, device: str) -> None:
    triton_device(device)
    _check(make_case(**CASES[name], device=device, seed=list(CASES).index(name)))


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_tokens=st.integers(1, 96),
    num_slots=st.integers(1, 16),
    rank=st.sampled_from([8, 16, 64]),
    hidden=st.sampled_from([16, 48, 64]),
    widths=st.lists(st.sampled_from([16, 24, 64]), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    rank_choice=st.lists(st.sampled_from([0, 8, 16, 64]), min_size=16, max_size=16),
    pass_ranks=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_triton_matches_reference_random(
    device: str, num_tokens, num_slots, rank, hidden, widths, dtype, rank_choice, pass_ranks, seed
) -> None:
    triton_device(device)
    slot_ranks = [min(r, rank) for r in rank_choice[:num_slots]]
    _check(
        make_case(
            num_tokens=num_tokens, num_slots=num_slots, rank=rank, hidden=hidden, widths=widths, dtype=dtype,
            device=device, slot_ranks=slot_ranks, pass_ranks=pass_ranks, seed=seed,
        )
    )  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("block_m", "prefetch"), [(16, False), (16, True), (64, True)])
@pytest.mark.slow
def test_split_k_and_column_chunks_match_reference(block_m: int, prefetch: bool, device: str) -> None:
    """Small blocks, so that K is split unevenly over 3 programs and each expand program loops over
    a chunk of several column blocks, with and without prefetch; GQA-like slices, mixed ranks."""
    triton_device(device)
    from kernels import triton_lora

    case = make_case(num_tokens=70, num_slots=5, rank=16, hidden=72, widths=[56, 24], dtype=torch.bfloat16,
                     device=device, slot_ranks=[16, 8, 16, 0, 16], pass_ranks=True, extra_columns=8,
                     seed=3)  # fmt: skip
    meta = case.meta()
    y_triton, y_torch = case.y.clone(), case.y.clone()
    h = triton_lora.shrink(case.x, case.As, meta, case.ranks, triton_lora.ShrinkConfig(block_m, 32, 3, 4, 2))
    chunked = triton_lora.ExpandConfig(block_m, 16, 3 * meta.grid_tiles(block_m), prefetch, 4, 1)
    triton_lora.expand(y_triton, h, case.Bs, case.scaling, meta, case.offsets, case.ranks, chunked)
    lora_apply_sliced(y_torch, case.x, case.As, case.Bs, case.scaling, meta, case.offsets, ranks=case.ranks,
                      backend="torch")  # fmt: skip
    worst = ((y_triton.double() - y_torch.double()).abs() / case.bound().to(y_triton.device)).max().item()
    assert worst <= 1.0, f"{worst:.2f}x the error bound"
    assert torch.equal(y_triton[case.slots < 0], case.y[case.slots < 0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 64, 256, 1000])
def test_triton_matches_reference_at_model_size(num_tokens: int, dtype: torch.dtype) -> None:
    """Llama-3-8B sizes: hidden 4096, q/k/v slices of 4096/1024/1024, rank 16 and 64 mixed."""
    triton_device("cuda")
    _check(
        make_case(
            num_tokens=num_tokens, num_slots=32, rank=64, hidden=4096, widths=[4096, 1024, 1024], dtype=dtype,
            device="cuda", slot_ranks=[16, 64] * 16, pass_ranks=True, unused_slots=4, seed=num_tokens,
        )
    )  # fmt: skip


@pytest.mark.gpu
def test_decode_step_replays_in_a_cuda_graph() -> None:
    """prepare + apply captured once, replayed for new slot mixes, equals eager reference each time."""
    triton_device("cuda")
    num_tokens, num_slots = 64, 32
    case = make_case(num_tokens=num_tokens, num_slots=num_slots, rank=16, hidden=512, widths=[512, 128],
                     dtype=torch.bfloat16, device="cuda")  # fmt: skip
    meta = LoRAMeta(num_tokens, num_slots, "cuda")
    static_slots = case.slots.clone()
    static_y = case.y.clone()
    y0 = case.y.clone()

    def step() -> None:
        static_y.copy_(y0)
        meta.prepare(static_slots)
        lora_apply_sliced(static_y, case.x, case.As, case.Bs, case.scaling, meta, case.offsets)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        static_slots.copy_(torch.randint(-1, num_slots, (num_tokens,), generator=gen).cuda())
        graph.replay()
        expected = y0.clone()
        lora_apply_sliced(expected, case.x, case.As, case.Bs, case.scaling, LoRAMeta.build(static_slots, num_slots),
                          case.offsets, backend="torch")  # fmt: skip
        replay_case = Case(y0, case.x, case.As, case.Bs, case.scaling, static_slots.clone(), case.offsets, None)
        assert ((static_y.double() - expected.double()).abs() <= replay_case.bound()).all()
        assert not torch.equal(static_y, y0)


@pytest.mark.gpu
def test_apply_never_synchronises_with_the_host() -> None:
    triton_device("cuda")
    case = make_case(num_tokens=16, num_slots=4, rank=16, hidden=256, widths=[256], dtype=torch.bfloat16,
                     device="cuda", pass_ranks=True)  # fmt: skip
    meta = case.meta()
    lora_apply(case.y, case.x, case.As[0], case.Bs[0], case.scaling, meta, ranks=case.ranks)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        meta.prepare(case.slots)
        lora_apply(case.y, case.x, case.As[0], case.Bs[0], case.scaling, meta, ranks=case.ranks)
    finally:
        torch.cuda.set_sync_debug_mode("default")
