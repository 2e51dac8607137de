"""bench/quantized_agreement.py: its INT4 checkpoint writer (a real model directory rounded to INT4 is
what the engine loads as an AWQ checkpoint, and it serves the same greedy tokens as the unquantized
model whose projection weights are ``dequantize(quantize(W))``, the bench's ``dequantize_projections``,
the twin its teacher-forced agreement runs on, so the bench measures quantization, not a loader's
slip); its counting of agreeing positions; and the engine's teacher-forced most likely tokens the FP8
measurement compares (read from ``prompt_logprobs``, one a position, none shifted by one)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from peft_reference import PeftReference, assert_greedy_match
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from bench.quantized_agreement import (
    Agreement,
    Scores,
    answer_gaps,
    checkpoint_group_size,
    count_agreement,
    dequantize_projections,
    engine_scores,
    rtn_weight,
    top1_agreement,
    top_token,
    write_rtn_awq,
)
from kernels import int4
from serving.engine import LLM, Logprob, LoRARequest, SamplingParams
from serving.engine.layers.int4_linear import AWQSpec

NEW_TOKENS = 10

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def written(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(awq_dir, twin_dir)``: the bench's checkpoint of the tiny Llama, and the tiny Llama with its
    projections replaced by ``dequantize_projections`` and saved as a plain model."""
    root = tmp_path_factory.mktemp("int4-agreement")
    awq_dir = write_rtn_awq(tiny_llama_dir, root / "awq")
    group = json.loads((awq_dir / "config.json").read_text())["quantization_config"]["group_size"]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    dequantize_projections(model, group)
    twin = root / "twin"
    model.save_pretrained(twin)
    for name in tiny_llama_dir.iterdir():
        if name.name.startswith("tokenizer") or name.name == "special_tokens_map.json":
            shutil.copy(name, twin / name.name)
    return awq_dir, twin


def test_the_group_is_the_largest_multiple_of_16_up_to_128_dividing_every_input() -> None:
    assert checkpoint_group_size([576, 1536]) == 96  # SmolLM2-135M: hidden 576, MLP 1536
    assert checkpoint_group_size([4096, 14336]) == 128
    assert checkpoint_group_size([64, 128]) == 64
    with pytest.raises(ValueError, match="no common group"):
        checkpoint_group_size([72, 144])


def test_the_checkpoint_holds_every_projection_rounded_and_the_rest_unchanged(tiny_llama_dir: Path,
                                                                              written: tuple[Path, Path]) -> None:  # fmt: skip
    awq_dir, _ = written
    config = json.loads((awq_dir / "config.json").read_text())
    group = config["quantization_config"]["group_size"]
    assert config["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": group,
                                             "zero_point": True, "version": "gemm"}  # fmt: skip
    assert (awq_dir / "tokenizer.json").is_file()
    (source,) = tiny_llama_dir.glob("*.safetensors")
    original, stored = load_file(str(source)), load_file(str(awq_dir / "model.safetensors"))
    projections = [name for name in original if name.endswith("_proj.weight")]
    assert len(projections) == 14  # two layers of q/k/v/o, gate/up/down
    for name, tensor in original.items():
        prefix = name.removesuffix(".weight")
        if name in projections:
            assert name not in stored
            weight = int4.dequantize(stored[f"{prefix}.qweight"], stored[f"{prefix}.qzeros"], stored[f"{prefix}.scales"],
                                     group, torch.float32).t()  # fmt: skip
            assert torch.equal(weight, rtn_weight(tensor, group)), name
            assert (weight - tensor).abs().max() > 0, f"{name} was not rounded"
        else:
            assert torch.equal(stored[name], tensor), name


def test_the_engine_serves_the_checkpoint_as_the_dequantized_twin(tiny_llama_dir: Path, written: tuple[Path, Path],
                                                                  make_adapter: Callable[..., Path]) -> None:  # fmt: skip
    awq_dir, twin = written
    adapter = make_adapter(tiny_llama_dir, r=8, lora_alpha=16, seed=4, init_scale=0.5,
                           target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    llm = LLM(str(awq_dir), device="cpu", dtype="float32", max_loras=1, max_lora_rank=8, max_num_seqs=4,
              max_model_len=64)  # fmt: skip
    group = json.loads((awq_dir / "config.json").read_text())["quantization_config"]["group_size"]
    assert all(layer.awq == AWQSpec(group) for layer in llm.llm_engine.runner.model.lora_layers())
    prompts = ["the cat sat on", "a quick brown fox", "once upon a time there", "hello world"]
    loras = [None, LoRARequest("a", str(adapter)), None, LoRARequest("a", str(adapter))]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                           lora_request=loras)  # fmt: skip
    reference = PeftReference(twin, {"a": adapter})
    original = PeftReference(tiny_llama_dir, {"a": adapter})
    tokenizer = llm.get_tokenizer()
    rounded = 0
    for prompt, lora, output in zip(prompts, loras, outputs):
        ids = tokenizer(prompt).input_ids
        name = lora.lora_name if lora else None
        assert_greedy_match(output.outputs[0].token_ids, reference.generate(ids, name, NEW_TOKENS), f"{name} {prompt!r}")
        rounded += output.outputs[0].token_ids != original.generate(ids, name, NEW_TOKENS).token_ids
    # The match above tells the rounded weights from the original ones only where they differ in tokens.
    assert rounded, "the unrounded model gives the same tokens: the test cannot tell a loader that skips the rounding"


class _NextToken(torch.nn.Module):
    """A model whose top token after ``t`` is ``next_of(t)``."""

    def __init__(self, next_of: Callable[[int], int]) -> None:
        super().__init__()
        self.next_of = next_of

    def forward(self, batch: torch.Tensor) -> SimpleNamespace:
        logits = torch.zeros(*batch.shape, 16)
        for position, token in enumerate(batch[0].tolist()):
            logits[0, position, self.next_of(token)] = 1.0
        return SimpleNamespace(logits=logits)


def test_agreement_counts_answer_positions_and_each_distinct_prefix_once() -> None:
    reference = _NextToken(lambda t: t + 1)
    quantized = _NextToken(lambda t: 0 if t == 3 else t + 1)  # disagrees after token 3 alone
    # The second sequence shares the prefix (1, 2) with the first: its first two positions are not new.
    agreement = top1_agreement(reference, quantized, [([1, 2, 3, 4], 2), ([1, 2, 5, 3, 6], 3)])
    # Answers: after 2 and 3 in the first (3 disagrees), after 5 and 3 in the second (3 disagrees).
    # Distinct positions: 1, 1-2, 1-2-3 of the first; 1-2-5, 1-2-5-3 of the second.
    assert agreement == Agreement(answer_agree=2, answer_positions=4, all_agree=3, all_positions=5)


def test_counting_takes_each_models_predictions_as_given() -> None:
    """The FP8 measurement's path: the predictions come from the engines, not from models here."""
    sequences = [([1, 2, 3, 4], 2), ([1, 2, 5, 3, 6], 3)]
    reference = [[2, 3, 4], [2, 5, 3, 6]]
    quantized = [[2, 3, 0], [2, 5, 3, 0]]  # the last position of each disagrees
    assert count_agreement(sequences, reference, quantized) == Agreement(answer_agree=2, answer_positions=4,
                                                                         all_agree=3, all_positions=5)  # fmt: skip
    with pytest.raises(ValueError, match="4 tokens need 3 predictions"):
        count_agreement(sequences[:1], [[2, 3]], [[2, 3]])


def test_the_top_token_is_the_texts_where_it_ranks_first() -> None:
    assert top_token({7: Logprob(-0.1, 1)}, 7) == 7
    assert top_token({7: Logprob(-2.0, 3), 9: Logprob(-0.2, 1)}, 7) == 9
    # A tie for the first place: the text's token, which the engine ranks 1 too.
    assert top_token({7: Logprob(-0.5, 1), 9: Logprob(-0.5, 1)}, 7) == 7


def test_the_engine_ranks_its_greedy_tokens_first_at_their_positions(tiny_llama_dir: Path,
                                                                      make_adapter: Callable[..., Path]) -> None:  # fmt: skip
    """fp32 on the CPU: teacher-forced, the engine's most likely token after each prefix of a prompt
    and its greedy continuation is the continuation's next token, with an adapter and without."""
    adapter = make_adapter(tiny_llama_dir, r=8, lora_alpha=16, seed=4, init_scale=0.5,
                           target_modules=("q_proj", "v_proj"))  # fmt: skip
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", max_loras=1, max_lora_rank=8, max_num_seqs=4,
              max_model_len=64)  # fmt: skip
    prompts = [[5, 17, 33, 2, 91], [5, 17, 33, 40]]  # a shared prefix, as the bench's system prompt
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for lora in (None, LoRARequest("a", str(adapter))):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora)
        sequences = [(p + list(o.outputs[0].token_ids), len(p)) for p, o in zip(prompts, outputs)]
        scores = engine_scores(llm, sequences, lora)
        tops = scores.top
        assert [len(t) for t in tops] == [len(g) for g in scores.gap] == [len(ids) - 1 for ids, _ in sequences]
        assert all(gap >= 0 for gaps in scores.gap for gap in gaps)
        for (ids, start), top in zip(sequences, tops):
            assert top[start - 1 :] == ids[start:], lora
        agreement = count_agreement(sequences, tops, [ids[1:] for ids, _ in sequences])
        assert agreement.answer_agree == agreement.answer_positions == 2 * NEW_TOKENS


def test_the_gaps_are_the_references_at_the_answers_positions() -> None:
    sequences = [([1, 2, 3, 4], 2), ([1, 2, 5], 2)]
    reference = Scores(top=[[2, 3, 4], [2, 5]], gap=[[0.9, 0.5, 0.25], [0.9, 2.0]])
    every, parted = answer_gaps(sequences, reference, [[2, 3, 0], [0, 5]])  # the prompt's disagreement not counted
    assert every == [0.5, 0.25, 2.0] and parted == [0.25]
