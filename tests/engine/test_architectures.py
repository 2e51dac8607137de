"""Architectures beyond Llama/Qwen2/Mistral, each on a tiny random model built from its real
config's shape (serving.engine.tiny): greedy tokens (and each token's log-probability) with an
adapter on every projection equal transformers + PEFT's, for prompts that cross the sliding
windows and one prefilled in chunks. Each tiny config's own difference (RoPE scaling, soft-caps,
windows, RoPE bases) changes what the model says, so a model that ignored it would fail. On
CUDA (gpu mark) the same comparison runs in fp32 through the Triton kernels (the soft-capped
attention, Gemma's norm) with decode steps replayed from CUDA graphs. RoPE
types whose frequencies depend on the sequence length, unknown ones and unsupported architectures
are refused at start, naming what is supported. (The mixed-batch test,
tests/engine/test_llm_multi_lora.py, runs the Llama family's tiny architectures.)"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from peft_reference import PeftReference, assert_greedy_match

from serving.engine import LLM, LoRARequest, SamplingParams
from serving.engine.layers.rotary import STATIC_ROPE_TYPES
from serving.engine.models import SUPPORTED_MODEL_TYPES

PROMPTS = [
    "Once upon a time there was a little house at the edge of the forest, and in it lived",
    "Hello!",
    # Long enough to be prefilled in two chunks (max_num_batched_tokens below) past every window.
    "Zebras quietly juggle 17 purple xylophones; meanwhile, grumpy krakens bake waffles.",
]
SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # Phi-3's modules, as PEFT adapts them
MAX_TOKENS = 12
LOGPROB_TOLERANCE = 1e-4
_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=_CUDA)]

pytestmark = pytest.mark.usefixtures("one_thread")


def _edit_config(base: Path, out: Path, **changes: Any) -> Path:
    """A copy of ``base`` (same weights) whose config.json has ``changes`` (None removes a key)."""
    other = shutil.copytree(base, out)
    config = json.loads((other / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (other / "config.json").write_text(json.dumps(config))
    return other


def _assert_serves_like_peft(base: Path, adapter: Path, what: str, device: str = "cpu") -> None:
    """Every prompt, with the adapter and without, in one batch: PEFT's greedy tokens and, up to
    where a near-tie lets the two part ways, PEFT's log-probabilities of them (PEFT on the CPU)."""
    llm = LLM(str(base), max_loras=1, max_lora_rank=8, device=device, dtype="float32", max_model_len=128,
              block_size=4, num_kv_blocks=96, max_num_batched_tokens=32)  # fmt: skip
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer(prompt).input_ids for prompt in PROMPTS]
    assert len(ids[2]) > 32 + 16, "the long prompt must need two prefill chunks, each past every window"
    loras: list[LoRARequest | None] = [LoRARequest("ad", str(adapter)), None] * len(ids)
    inputs = [{"prompt_token_ids": prompt} for prompt in ids for _ in (0, 1)]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(inputs, greedy, lora_request=loras)
    reference = PeftReference(base, {"ad": adapter})
    for prompt, lora, output in zip(inputs, loras, outputs):
        name = lora.lora_name if lora else None
        ours = output.outputs[0]
        ref = reference.generate(prompt["prompt_token_ids"], name, MAX_TOKENS)
        label = f"{what} {'+ adapter' if name else 'base'} ({len(prompt['prompt_token_ids'])} prompt tokens)"
        assert_greedy_match(ours.token_ids, ref, label)
        assert ours.logprobs is not None
        for step, (token, theirs) in enumerate(zip(ours.token_ids, ref.token_ids)):
            if token != theirs:
                break
            expected = float(ref.logits[step].log_softmax(-1)[token])
            assert math.isclose(ours.logprobs[step][token].logprob, expected, abs_tol=LOGPROB_TOLERANCE), (
                f"{label}: token {step}'s log-probability {ours.logprobs[step][token].logprob} is not PEFT's {expected}")
    with_adapter = [o.outputs[0].token_ids for o, lora in zip(outputs, loras) if lora]
    assert with_adapter != [o.outputs[0].token_ids for o, lora in zip(outputs, loras) if not lora]


def _moved(base: Path, other: Path, adapter: Path) -> float:
    """How far ``other``'s log-probabilities of ``base``'s greedy picks lie from ``base``'s, at
    worst over a 41-token prompt (PEFT, the adapter on)."""
    ids = torch.tensor([[1, *range(40, 80)]])
    with torch.no_grad():
        ours = PeftReference(base, {"ad": adapter}).model(input_ids=ids).logits[0].log_softmax(-1)
        theirs = PeftReference(other, {"ad": adapter}).model(input_ids=ids).logits[0].log_softmax(-1)
    picks = ours.argmax(-1, keepdim=True)
    return float((ours.gather(-1, picks) - theirs.gather(-1, picks)).abs().max())

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("arch", "targets"), [
    ("qwen3", SPLIT), ("llama3", SPLIT), ("phi3", FUSED), ("gemma2", SPLIT), ("gemma3_text", SPLIT),
])  # fmt: skip
@pytest.mark.slow
def test_greedy_tokens_match_peft(arch: str, targets: tuple[str, ...], device: str,
                                  tiny_model_factory: Callable[..., Path], make_adapter: Callable[..., Path]) -> None:
    base = tiny_model_factory(arch)
    adapter = make_adapter(base, r=8, lora_alpha=16, target_modules=targets, seed=7, init_scale=0.5)
    _assert_serves_like_peft(base, adapter, f"{arch} on {device}", device)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    # YaRN also scales cos/sin (its attention factor); a 32-token original context, as llama3's above.
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0},
], ids=["linear", "yarn"])  # fmt: skip
@pytest.mark.slow
def test_other_fixed_rope_scalings_match_peft(rope: dict[str, Any], tiny_llama_dir: Path, tmp_path: Path,
                                              make_adapter: Callable[..., Path]) -> None:
    base = _edit_config(tiny_llama_dir, tmp_path / rope["rope_type"], rope_parameters=rope)
    adapter = make_adapter(base, r=8, lora_alpha=16, target_modules=SPLIT, seed=7, init_scale=0.5)
    _assert_serves_like_peft(base, adapter, f"llama with {rope['rope_type']} RoPE scaling")
    assert _moved(base, tiny_llama_dir, adapter) > 100 * LOGPROB_TOLERANCE, "the scaling must change the model"


# Each tiny architecture's difference and the config without it (same weights, same adapter): the
# log-probabilities of the model's own greedy picks must move by far more than the comparison's
# tolerance somewhere in a prompt, or the PEFT comparison above could not tell a model ignoring it.
DIFFERENCES = {
    "llama3 RoPE scaling": ("llama3", SPLIT, {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
    "phi3 sliding window": ("phi3", FUSED, {"sliding_window": None}),
    "gemma2 attention soft-cap": ("gemma2", SPLIT, {"attn_logit_softcapping": None}),
    "gemma2 sliding window": ("gemma2", SPLIT, {"sliding_window": 64}),
    "gemma3 local RoPE base": ("gemma3_text", SPLIT, {"rope_local_base_freq": 1_000_000.0, "rope_parameters": None}),
    "gemma3 sliding window": ("gemma3_text", SPLIT, {"sliding_window": 64}),
}


@pytest.mark.parametrize("difference", sorted(DIFFERENCES))
def test_each_architectures_difference_moves_its_log_probabilities(
    difference: str, tiny_model_factory: Callable[..., Path], make_adapter: Callable[..., Path], tmp_path: Path
) -> None:
    arch, targets, changes = DIFFERENCES[difference]
    base = tiny_model_factory(arch)
    adapter = make_adapter(base, r=8, lora_alpha=16, target_modules=targets, seed=7, init_scale=0.5)
    without = _edit_config(base, tmp_path / "without", **changes)
    moved = _moved(base, without, adapter)
    assert moved > 100 * LOGPROB_TOLERANCE, f"{difference}: log-probabilities move by {moved:.1e} only without it"



def test_final_logit_soft_cap_bounds_the_logits(tiny_model_factory: Callable[..., Path]) -> None:
    """Gemma 2's final cap keeps greedy tokens (tanh is monotonic) and shows in the log-probabilities,
    which the comparison above checks; here that the tiny cap really bounds the logits."""
    base = tiny_model_factory("gemma2")
    reference = PeftReference(base, {})
    logits = reference.generate([1, 40, 41, 42], None, 2).logits[0]
    cap = reference.model.config.final_logit_softcapping
    assert float(logits.abs().max()) < cap
    assert float(logits.abs().max()) > cap / 2, "the cap must bite on the tiny model's logits"


def test_reference_soft_caps_attention_whatever_transformers_defaults_to(tiny_model_factory: Callable[..., Path],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5.17 (the GPU machine's) declares SDPA for Gemma 2 and loads it so by default, and
    SDPA drops ``attn_logit_softcapping``: the oracle then disagreed with the engine (which caps) on
    the H200 only. Gemma 2 claims SDPA here as under 5.17; PEFT's reference must still cap."""
    from transformers import AutoModelForCausalLM
    from transformers.models.gemma2.modeling_gemma2 import Gemma2PreTrainedModel

    monkeypatch.setattr(Gemma2PreTrainedModel, "_supports_sdpa", True)
    base = tiny_model_factory("gemma2")
    ids = torch.tensor([[1, *range(40, 80)]])
    eager = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(PeftReference(base, {}).model(input_ids=ids).logits, eager(input_ids=ids).logits)


REFUSED_ROPE = {
    "dynamic": "rope_type 'dynamic' is not supported: dynamic NTK scaling changes the frequencies with the "
               "sequence's length; the engine serves default, linear, llama3, yarn",
    "longrope": "rope_type 'longrope' is not supported: LongRoPE (Phi-3's su) changes the frequencies with the "
                "sequence's length; the engine serves default, linear, llama3, yarn",
    "wavy": "unknown rope_type 'wavy'; the engine serves default, linear, llama3, yarn",
}


@pytest.mark.parametrize("rope_type", sorted(REFUSED_ROPE))
def test_a_rope_type_the_engine_cannot_compute_is_refused_naming_it(rope_type: str, tiny_llama_dir: Path,
                                                                    tmp_path: Path) -> None:
    rope = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0}
    if rope_type == "longrope":  # Phi-3's 128k configs: one factor per rotated frequency
        rope |= {"short_factor": [1.0] * 8, "long_factor": [4.0] * 8, "original_max_position_embeddings": 64}
    base = _edit_config(tiny_llama_dir, tmp_path / rope_type, rope_parameters=rope)
    with pytest.raises(ValueError, match=re.escape(REFUSED_ROPE[rope_type])):
        LLM(str(base), max_loras=0, device="cpu")
    assert STATIC_ROPE_TYPES == ("default", "linear", "llama3", "yarn")


def test_an_unsupported_architecture_is_refused_naming_the_supported(tiny_llama_dir: Path, tmp_path: Path) -> None:
    other = _edit_config(tiny_llama_dir, tmp_path / "phi", model_type="phi")
    with pytest.raises(ValueError, match=f"model_type 'phi' is not supported; the engine serves {', '.join(SUPPORTED_MODEL_TYPES)}"):
        LLM(str(other), max_loras=0, device="cpu")
    assert {"qwen3", "phi3", "gemma2", "gemma3_text"} <= set(SUPPORTED_MODEL_TYPES)


def test_an_unsupported_activation_is_refused_naming_the_supported(tiny_llama_dir: Path, tmp_path: Path) -> None:
    other = _edit_config(tiny_llama_dir, tmp_path / "relu2", hidden_act="relu2")
    with pytest.raises(ValueError, match="unsupported MLP activation 'relu2': the engine runs gelu, gelu_pytorch_tanh, "
                                         "silu, swish"):
        LLM(str(other), max_loras=0, device="cpu")


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_dummy_weights_make_every_norm_the_identity(arch: str, tiny_model_factory: Callable[..., Path]) -> None:
    """load_format="dummy" (benchmarks on a shape without its weights): Gemma's norms scale by
    1 + weight, so theirs are zeros where Llama's are ones."""
    from serving.engine.layers.layernorm import RMSNorm

    llm = LLM(str(tiny_model_factory(arch)), max_loras=0, device="cpu", load_format="dummy")
    norms = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, RMSNorm)]
    x = torch.randn(3, llm.llm_engine.hf_config.hidden_size)
    identity = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norms[0].eps)
    per_layer = 4 if arch == "gemma2" else 2  # Gemma norms after attention and MLP as well as before
    assert len(norms) == per_layer * llm.llm_engine.hf_config.num_hidden_layers + 1
    for norm in norms:
        torch.testing.assert_close(norm(x)[0], identity)
