"""The trainer's memory model (training/memory_model.py): its arithmetic against bytes counted by
hand for a small shape, its parameter counts against the models torch and PEFT build (the tiny llama
and the Llama-3-70B shape, on the meta device), and bench/trainer_70b.py's CPU smoke run (in this process).
The measured peak is compared on the GPU only (bench/trainer_70b.py): the CPU has no allocator peak."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

from bench.random_adapters import LLAMA3_70B
from training.memory_model import PROJECTIONS, Setup, Shape, estimate, fit_line, fsdp_peak, lora_params

REPO = Path(__file__).resolve().parents[2]
SMALL = Shape(hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1, vocab=32, head_dim=4)
SETUP = Setup(rank=2, tokens=4, base_bytes=2, activation_bytes=2, workspace=0)


def test_the_small_shape_counts_as_by_hand() -> None:
    # A layer: q 8×8, k 8×4, v 8×4, o 8×8, gate/up/down 8×16 each, two norms of 8: 592 weights.
    assert SMALL.layer_params == 64 + 32 + 32 + 64 + 3 * 128 + 16 == 592
    # Embedding and head 32×8 each, the final norm 8; two layers.
    assert SMALL.params == 2 * 256 + 8 + 2 * 592 == 1704
    # Rank 2 × (fan_in + fan_out) summed over the seven projections, two layers.
    assert lora_params(SMALL, SETUP) == 2 * 2 * (16 + 12 + 12 + 16 + 24 + 24 + 24) == 512


def test_the_small_shape_peak_is_the_hand_computed_bytes() -> None:
    e = estimate(SMALL, SETUP)
    assert e.base == 1704 * 2
    assert e.lora == 512 * 12  # fp32 weights and AdamW's two moments
    assert e.lora_grads == 512 * 4
    # A token of a layer, bf16: each LoRA A's copy of its input (q, k, v, gate, up: 8; o: 8; down: 16)
    # and its output (2 each); roped q 8, roped k 4, v 4, attention output 8; gate, SiLU, up 3 × 16.
    # Then the fp32 norm inputs 2 × 8, their rsqrt, and the log-sum-exp of 2 heads.
    per_token = 2 * (5 * 8 + 8 + 16 + 7 * 2 + 8 + 4 + 4 + 8 + 3 * 16) + 4 * 16 + 8 + 4 * 2
    assert per_token == 380
    assert e.layer_activation == 4 * 380
    assert e.recompute == 4 * 380 + 4 * 2 * (2 * 16 + 2 * 8)
    assert e.loss == 4 * 32 * (2 + 12)  # bf16 logits, then fp32 log-softmax, its gradient, the logits' gradient
    assert e.head == 4 * 8 * (4 + 2)
    assert e.kept_activations == 2 * 4 * 8 * 2  # two layers' bf16 inputs
    # A layer's recompute and the LoRA gradients outweigh the loss here (a 32-token vocabulary).
    assert e.peak == 3408 + 6144 + 128 + (4 * 380 + 384) + 2048 == 13632
    # A 128k vocabulary turns it round: the loss is the transient at the peak.
    big_vocab = estimate(Shape(**{**SMALL.__dict__, "vocab": 4096}), SETUP)
    assert big_vocab.peak - big_vocab.base == 6144 + 128 + 4 * 4096 * 14 + 192


def test_without_checkpointing_every_layer_keeps_its_activations() -> None:
    e = estimate(SMALL, Setup(rank=2, tokens=4, workspace=0, gradient_checkpointing=False))
    # Every layer's activations and autocast's bf16 copies of the LoRA weights, which the backward needs.
    assert e.kept_activations == 2 * 4 * 380 + 512 * 2
    assert e.peak == 3408 + 6144 + 2 * 1520 + 1024 + 1792 + 192


def test_in_fp32_the_adapted_projections_share_their_inputs() -> None:
    # No casts on the CPU path: the norms' outputs (8 each) and the product (16) are saved once.
    fp32 = Setup(rank=2, tokens=1, base_bytes=4, activation_bytes=4, workspace=0)
    assert estimate(SMALL, fp32).layer_activation == 4 * (8 + 8 + 16 + 7 * 2 + 8 + 4 + 4 + 8 + 3 * 16) + 72 + 8
    attention_only = Setup(rank=2, tokens=1, targets=("q_proj", "v_proj"), base_bytes=4, activation_bytes=4)
    assert estimate(SMALL, attention_only).layer_activation == 4 * (8 + 2 * 2 + 8 + 4 + 4 + 8 + 3 * 16) + 72 + 8


def test_fsdp_shards_the_base_and_gathers_the_root_and_two_layers() -> None:
    gathered = (2 * 256 + 8) * 2 + 2 * 592 * 2
    assert fsdp_peak(SMALL, SETUP, 2) == 13632 - 3408 + 3408 // 2 + gathered
    full = Shape.from_config(LLAMA3_70B)
    setup = Setup()
    # On the 70B shape sharding pays: each GPU more holds less.
    peaks = [fsdp_peak(full, setup, gpus) for gpus in (1, 2, 4, 8)]
    assert peaks == sorted(peaks, reverse=True)


def test_the_70b_shape_does_not_fit_one_h200_at_2048_tokens() -> None:
    full = Shape.from_config(LLAMA3_70B)
    assert full.layers == 80
    assert 70.5e9 < full.params < 70.6e9  # Llama-3-70B's published 70.6 B
    assert estimate(full, Setup()).peak > 139 * 2**30


@pytest.mark.parametrize("config", [
    dict(LLAMA3_70B, num_hidden_layers=2),
    dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
         vocab_size=512, tie_word_embeddings=True),
], ids=["llama3-70b-cut-to-2", "tiny-tied"])
def test_the_parameter_counts_are_the_models_torch_builds(config: dict[str, object]) -> None:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**config))
    shape = Shape.from_config(config)
    assert shape.params == sum(param.numel() for param in model.parameters())
    adapted = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=list(PROJECTIONS)))
    trainable = sum(param.numel() for param in adapted.parameters() if param.requires_grad)
    assert lora_params(shape, Setup(rank=16)) == trainable


def test_fit_line_recovers_a_line() -> None:
    assert fit_line([(2, 10.0), (8, 22.0), (32, 70.0)]) == pytest.approx((6.0, 2.0))
    with pytest.raises(ValueError):
        fit_line([(2, 10.0)])


def test_the_cpu_smoke_run_trains_each_cut_and_reports_the_full_shape(tmp_path: Path, monkeypatch, one_thread) -> None:
    """The script run as its docstring runs it (`python3 bench/trainer_70b.py --shape tiny ...`), but in
    this process: runpy runs the file as `__main__` as the interpreter would, where a cold interpreter
    spent 4-5 s of CPU importing torch, transformers and PEFT before the script's first line (what is
    tested is the script's run and report, not a process boundary)."""
    out = tmp_path / "t70.json"
    script = REPO / "bench" / "trainer_70b.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--shape", "tiny", "--layers", "1,2", "--steps", "2",
                                      "--seq-len", "32", "--json", str(out)])
    # As the interpreter runs a script: its folder heads sys.path (restored after the test).
    monkeypatch.setattr(sys, "path", [str(script.parent), *sys.path])
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(script), run_name="__main__")
    assert exited.value.code == 0
    # The script put the repository there instead, which its imports need in a cold interpreter (here
    # they are imported already, so this is checked directly).
    assert sys.path[0] == str(REPO)
    results = json.loads(out.read_text())
    assert [run["layers"] for run in results["runs"]] == [1, 2]
    for run in results["runs"]:
        assert run["tokens_per_s"] > 0 and run["measured_peak_gib"] is None
        assert run["predicted"]["peak_gib"] > run["predicted"]["base_gib"] > 0
    assert results["full"]["layers"] == 2 and set(results["full"]["fsdp_per_gpu_gib"]) == {"2", "4", "8"}
