"""An adapter the platform's trainer made is served by the engine with PEFT's tokens.

The trainer runs on a tiny model of each layer structure (the Llama family's, Phi-3's fused
projections, Gemma 2's and Gemma 3's) where ``training.trainer.pick_device`` puts it (fp32 on CPU; on a
CUDA machine its bf16 path, the LoRA weights in fp32, its layers compiled except for DoRA:
training.compiled_layers), saves the adapter as a job does, and the engine serves it in fp32 (on
CPU, or on CUDA with graphs, DoRA's too: gpu mark) in a batch with the base model. The training
is the module fixture's: run alone (``-m gpu``), the CUDA test pays for it.
Every prompt's greedy tokens must equal PEFT's on the CPU for that adapter, and the adapter must
change what the base model says (so the comparison is not of two base models). "llama+dora" trains
a DoRA adapter (``use_dora``, docs/adapter-kinds.md) and serves it the same way; "llama+vocab" adapts
the vocabulary modules too (``embed_tokens`` and ``lm_head`` beside two projections: issue 41, item
4), which the engine serves per row (docs/adapter-kinds.md, "Vocabulary modules").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft_reference import PeftReference, assert_greedy_match
from safetensors import safe_open

from serving.engine import LLM, LoRARequest, SamplingParams
from training.examples import Example, encode_example
from training.hyperparameters import Hyperparameters
from training.trainer import LoraTrainer, StepMetrics, load_base

pytestmark = pytest.mark.usefixtures("one_thread")
_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PAIRS = [
    ("the quick brown", " fox jumps over the lazy dog"),
    ("a b c", " d e f g h i j"),
    ("one two", " three four five six"),
    ("over the lazy", " dog and then it runs away"),
]
MAX_TOKENS = 8


class _Hooks:
    def __init__(self) -> None:
        self.losses: list[float] = []

    def should_stop(self) -> bool:
        return False

    def on_step(self, step: int, total_steps: int, epoch: float, trained_tokens: int) -> None:
        pass

    def on_log(self, metrics: StepMetrics) -> None:
        if metrics.train_loss is not None:
            self.losses.append(metrics.train_loss)

    def on_checkpoint(self, step: int, directory: Path, metrics: dict[str, object]) -> None:
        pass


# The "vocab" kind's modules: two projections and both vocabulary modules.
VOCAB_TARGETS = ["q_proj", "v_proj", "embed_tokens", "lm_head"]


@pytest.fixture(scope="module", params=["llama", "phi3", "gemma2", "gemma3_text", "llama+dora", "llama+vocab"])
def trained(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path],
            tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[float]]:
    """``(base, adapter, losses)``: "all-linear" adapts every projection the base has."""
    arch, _, kind = request.param.partition("+")
    base_dir = tiny_model_factory(arch)
    base = load_base(str(base_dir))
    examples = [
        encode_example(Example(format="completion", prompt=prompt, completion=completion), base.tokenizer)
        for prompt, completion in PAIRS
    ]
    hp = Hyperparameters(n_epochs=6, batch_size=2, learning_rate=2e-2, max_seq_length=64, r=8, lora_alpha=16,
                         lora_dropout=0.0, warmup_ratio=0.0, use_dora=kind == "dora",
                         target_modules=VOCAB_TARGETS if kind == "vocab" else "all-linear")  # fmt: skip
    hooks = _Hooks()
    result = LoraTrainer(
        base, hp, seed=3, train=examples, valid=[], hooks=hooks, work_dir=tmp_path_factory.mktemp("job"),
        fingerprint="pairs-v1", base_model_name=base_dir.name, checkpoint_every=1000, log_every=2,
    ).run()  # fmt: skip
    return base_dir, result.adapter_dir, hooks.losses


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_CUDA)])
@pytest.mark.slow
def test_trained_adapter_is_served_with_peft_tokens(device: str, trained: tuple[Path, Path, list[float]]) -> None:
    base_dir, adapter_dir, losses = trained
    assert losses[-1] < losses[0], f"the trainer must learn: losses {losses}"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    fused = json.loads((base_dir / "config.json").read_text())["model_type"] == "phi3"
    projections = {"o_proj", "down_proj"} | ({"qkv_proj", "gate_up_proj"} if fused else
                                             {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
    if "embed_tokens" in config["target_modules"]:
        projections = set(VOCAB_TARGETS)
        # PEFT's LoRA on the embedding and on the head, and no copy of either matrix in the artifact.
        with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as weights:
            names = list(weights.keys())
        assert any("embed_tokens.lora_embedding_A" in name for name in names), names
        assert any("lm_head.lora_A" in name for name in names), names
        assert not any(name.endswith(("embed_tokens.weight", "lm_head.weight")) for name in names), names
    assert set(config["target_modules"]) == projections
    llm = LLM(str(base_dir), max_loras=1, max_lora_rank=8, max_num_seqs=4, max_model_len=64, device=device,
              dtype="float32")  # fmt: skip
    prompts = [prompt for prompt, _ in PAIRS] * 2
    loras = [LoRARequest("trained", str(adapter_dir)) if i < len(PAIRS) else None for i in range(len(prompts))]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), lora_request=loras)

    reference = PeftReference(base_dir, {"trained": adapter_dir})
    tokenizer = llm.get_tokenizer()
    by_adapter: dict[str | None, list[list[int]]] = {"trained": [], None: []}
    for prompt, lora, output in zip(prompts, loras, outputs):
        name = lora.lora_name if lora else None
        ids = tokenizer(prompt).input_ids
        ours = output.outputs[0].token_ids
        assert_greedy_match(ours, reference.generate(ids, name, MAX_TOKENS), f"{name} {prompt!r}")
        by_adapter[name].append(ours)
    assert by_adapter["trained"] != by_adapter[None], "the trained adapter must change the base model's tokens"
