"""The torch reference against an exact fp64 oracle, in both of its strategies."""

from __future__ import annotations

import pytest
import torch
from lora_cases import make_case

import kernels.cpu_lora as cpu_lora
from kernels import lora_apply, lora_apply_sliced


@pytest.fixture(params=["dense", "grouped"])
def strategy(request, monkeypatch) -> str:
    """Force the reference's strategy: small steps use all-slots GEMMs, large ones group by slot."""
    monkeypatch.setattr(cpu_lora, "DENSE_MAX_MACS", 1 << 40 if request.param == "dense" else 0)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pass_ranks", [False, True])
@pytest.mark.slow
def test_reference_matches_exact(strategy: str, dtype: torch.dtype, pass_ranks: bool) -> None:
    case = make_case(num_tokens=70, num_slots=8, rank=64, hidden=96, widths=[64, 16, 16], dtype=dtype,
                     slot_ranks=[8, 16, 64, 0, 8, 16, 64, 16], pass_ranks=pass_ranks, extra_columns=4,
                     unused_slots=2, seed=3)  # fmt: skip
    y = case.y.clone()
    lora_apply_sliced(y, case.x, case.As, case.Bs, case.scaling, case.meta(), case.offsets, ranks=case.ranks)
    diff = (y.double() - case.exact()).abs()
    assert (diff <= case.bound()).all(), f"{(diff / case.bound()).max().item():.2f}x the error bound"
    assert not torch.equal(y, case.y)


def test_tokens_without_adapter_and_other_columns_are_untouched(strategy: str) -> None:
    case = make_case(num_tokens=40, num_slots=3, rank=16, hidden=32, widths=[16, 16], extra_columns=5,
                     no_adapter_fraction=0.5, seed=5)  # fmt: skip
    y = case.y.clone()
    lora_apply_sliced(y, case.x, case.As, case.Bs, case.scaling, case.meta(), case.offsets)
    base = case.slots < 0
    assert base.any() and torch.equal(y[base], case.y[base])
    for gap in (16, 37):
        assert torch.equal(y[:, gap : gap + 5], case.y[:, gap : gap + 5])


def test_rank_zero_slot_costs_nothing_and_adds_nothing(strategy: str) -> None:
    case = make_case(num_tokens=12, num_slots=2, rank=16, hidden=32, widths=[16], slot_ranks=[0, 16],
                     pass_ranks=True, no_adapter_fraction=0.0, unused_slots=0, seed=7)  # fmt: skip
    y = case.y.clone()
    lora_apply(y, case.x, case.As[0], case.Bs[0], case.scaling, case.meta(), ranks=case.ranks)
    zero_rank = case.slots == 0
    assert zero_rank.any() and torch.equal(y[zero_rank], case.y[zero_rank])
    assert not torch.equal(y[~zero_rank], case.y[~zero_rank])


def test_empty_step_is_a_no_op() -> None:
    case = make_case(num_tokens=0, num_slots=2, rank=16, hidden=32, widths=[16])
    y = case.y.clone()
    lora_apply(y, case.x, case.As[0], case.Bs[0], case.scaling, case.meta())
    assert y.shape == (0, 16)
