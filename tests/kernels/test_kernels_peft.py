"""The multi-LoRA op agrees with PEFT: adapters stacked into slots give PEFT's output per token."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import kernels.cpu_lora as cpu_lora
from kernels import LoRAMeta, lora_apply_sliced

HIDDEN, Q, KV = 64, 64, 16  # a GQA-shaped attention input: q is 4x wider than k and v
MAX_RANK, NUM_SLOTS = 16, 6
# name -> (rank, lora_alpha, use_rslora, slot)
ADAPTERS = {"support": (4, 8, False, 3), "legal": (16, 16, False, 0), "sales": (8, 32, True, 5)}


class Attention(nn.Module):
    """The projections of one attention layer, as transformers' Llama has them."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, Q)
        self.k_proj = nn.Linear(HIDDEN, KV)
        self.v_proj = nn.Linear(HIDDEN, KV)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)


def _peft_model() -> nn.Module:
    torch.manual_seed(0)
    model = None
    for name, (rank, alpha, rslora, _) in ADAPTERS.items():
        # init_lora_weights=False: B random too, so every adapter changes the output.
        config = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, init_lora_weights=False,
                            target_modules=["q_proj", "k_proj", "v_proj"])  # fmt: skip
        if model is None:
            model = get_peft_model(Attention(), config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    return model.eval()


def _stack_slots(model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Copy each adapter into its slot, zero-padded to MAX_RANK, as the engine loads them."""
    layer = model.base_model.model
    As, Bs = [], []
    scaling = torch.zeros(NUM_SLOTS)
    ranks = torch.zeros(NUM_SLOTS, dtype=torch.int32)
    for proj in (layer.q_proj, layer.k_proj, layer.v_proj):
        A = torch.zeros(NUM_SLOTS, MAX_RANK, HIDDEN)
        B = torch.zeros(NUM_SLOTS, proj.out_features, MAX_RANK)
        for name, (rank, _, _, slot) in ADAPTERS.items():
            A[slot, :rank] = proj.lora_A[name].weight.detach()
            B[slot, :, :rank] = proj.lora_B[name].weight.detach()
            scaling[slot] = proj.scaling[name]
            ranks[slot] = rank
        As.append(A)
        Bs.append(B)
    return As, Bs, scaling, ranks


# The torch backend's two CPU paths, forced through its cost model's constants: every group in one
# grid, or every group run one by one at its own rank (kernels/cpu_lora.py). Each must match PEFT.
TORCH_PATHS = {"grid": {"LOOP_GROUP_MACS": 1 << 60, "DENSE_MAX_MACS": 1 << 60}, "loop": {"DENSE_MAX_MACS": 0}}


@pytest.mark.parametrize("backend", ["torch-grid", "torch-loop", "triton"])
@pytest.mark.parametrize("pass_ranks", [False, True])
def test_mixed_batch_matches_peft(backend: str, pass_ranks: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    path = None
    if backend == "triton":
        import kernels.triton_lora as triton_lora

        if not triton_lora.INTERPRETED:
            pytest.skip("Triton's interpreter is off on this machine")
    else:
        backend, path = backend.split("-")
        for constant, value in TORCH_PATHS[path].items():
            monkeypatch.setattr(cpu_lora, constant, value)
    model = _peft_model()
    names = ["support", "__base__", "legal", "sales", "legal", "support", "__base__", "sales"] * 3
    x = torch.randn(len(names), HIDDEN)
    with torch.no_grad():
        expected = model(x, adapter_names=names)
        with model.disable_adapter():
            y = model(x)

    As, Bs, scaling, ranks = _stack_slots(model)
    slots = torch.tensor([ADAPTERS[n][3] if n != "__base__" else -1 for n in names])
    meta = LoRAMeta.build(slots, NUM_SLOTS)
    if path is not None:
        plan = cpu_lora._plan(meta, As, Bs, ranks if pass_ranks else None)
        looped = sorted(slot for slot, _, _ in plan.looped)
        assert (plan.grid is None, looped) == ((False, []) if path == "grid" else (True, [0, 3, 5])), plan
    lora_apply_sliced(y, x, As, Bs, scaling, meta, ranks=ranks if pass_ranks else None, backend=backend)

    assert scaling[5] == 32 / 8**0.5, "rsLoRA scaling (alpha / sqrt(r)) is PEFT's, carried per slot"
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    base_rows = slots < 0
    with torch.no_grad(), model.disable_adapter():
        assert torch.equal(y[base_rows], model(x)[base_rows])
