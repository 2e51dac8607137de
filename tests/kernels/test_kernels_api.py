"""Argument checks and backend dispatch of the public entry points."""

from __future__ import annotations

import pytest
import torch
from lora_cases import make_case

import kernels
from kernels import LoRAMeta, lora_apply, lora_apply_sliced, resolve_backend, use_backend


@pytest.fixture
def case():
    return make_case(num_tokens=6, num_slots=3, rank=8, hidden=16, widths=[12, 4], seed=1)


def test_auto_dispatch_is_torch_on_cpu_and_triton_on_cuda() -> None:
    assert resolve_backend(torch.device("cpu")) == "torch"
    assert resolve_backend(torch.device("cuda")) == "triton"
    assert resolve_backend(torch.device("cpu"), "triton") == "triton"


def test_use_backend_overrides_the_default_until_the_block_ends() -> None:
    with use_backend("triton"):
        assert resolve_backend(torch.device("cpu")) == "triton"
        with use_backend("torch"):
            assert resolve_backend(torch.device("cuda")) == "torch"
        assert resolve_backend(torch.device("cuda"), "torch") == "torch", "a call's own backend wins"
    assert resolve_backend(torch.device("cpu")) == "torch"


def test_unknown_backend_is_refused(case) -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        with use_backend("cuda"):
            pass
    with pytest.raises(ValueError, match="backend must be one of"):
        lora_apply(case.y[:, :12], case.x, case.As[0], case.Bs[0], case.scaling, case.meta(), backend="fast")


def test_public_names() -> None:
    assert set(kernels.__all__) >= {"LoRAMeta", "lora_apply", "lora_apply_sliced", "use_backend"}


BAD_CALLS = {
    "too many slices": (lambda c: dict(As=c.As * 2, Bs=c.Bs * 2), "1 to 3 slices"),
    "A/B count": (lambda c: dict(Bs=c.Bs[:1]), "1 to 3 slices"),
    "x not 2-D": (lambda c: dict(x=c.x[None]), "must be 2-D"),
    "token count": (lambda c: dict(y=c.y[:5]), "x has 6 tokens but y has 5"),
    "meta tokens": (lambda c: dict(meta=LoRAMeta.build(c.slots[:4], 3)), "meta was prepared for 4 tokens, x has 6"),
    "int x": (lambda c: dict(x=c.x.to(torch.int32)), "x must be one of"),
    "A shape": (lambda c: dict(As=[c.As[0], c.As[1][:, :, :8]]), r"A\[1\] must be \[S=3, R=8, K=16\]"),
    "B rank": (lambda c: dict(Bs=[c.Bs[0], c.Bs[1][:, :, :4]]), r"B\[1\] must be \[S=3, N, R=8\]"),
    "dtype mix": (lambda c: dict(y=c.y.double()), "y is torch.float64 but x is torch.float32"),
    "too few slots": (lambda c: dict(meta=LoRAMeta.build(c.slots, 4)), "A has 3 slots but meta allows slot ids up to"),
    "scaling shape": (lambda c: dict(scaling=c.scaling[:2]), r"scaling must be a float tensor \[S=3\]"),
    "ranks dtype": (lambda c: dict(ranks=torch.tensor([8, 8, 8])), r"ranks must be an int32 tensor \[S=3\]"),
    "ranks range": (lambda c: dict(ranks=torch.tensor([8, 9, 0], dtype=torch.int32)), r"ranks must lie in \[0, 8\]"),
    "offset count": (lambda c: dict(slice_offsets=[0]), "2 slices but 1 slice_offsets"),
    "slice past y": (lambda c: dict(slice_offsets=[0, 14]), r"slice 1 \(columns 14..18\) does not fit y's 16 columns"),
    "overlap": (lambda c: dict(slice_offsets=[0, 10]), "slices overlap: columns 0..12 and from 10"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_arguments_get_a_clear_error(case, name: str) -> None:
    change, message = BAD_CALLS[name]
    args = dict(y=case.y, x=case.x, As=case.As, Bs=case.Bs, scaling=case.scaling, meta=case.meta(),
                slice_offsets=case.offsets, ranks=None)  # fmt: skip
    args.update(change(case))
    before = case.y.clone()
    with pytest.raises((ValueError, TypeError), match=message):
        lora_apply_sliced(args.pop("y"), args.pop("x"), args.pop("As"), args.pop("Bs"), args.pop("scaling"),
                          args.pop("meta"), args.pop("slice_offsets"), **args)  # fmt: skip
    assert torch.equal(case.y, before), "nothing is written when the arguments are refused"
