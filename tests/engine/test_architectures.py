"""Architectures beyond Llama/Qwen2/Mistral, each on a tiny random model built from its real
config's shape (serving.engine.tiny): greedy tokens with an adapter on every projection equal
transformers + PEFT's. An unsupported architecture is refused at start, naming the supported ones.
(The mixed-batch test, tests/engine/test_llm_multi_lora.py, runs every tiny architecture too.)"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from peft_reference import PeftReference, assert_greedy_match

from serving.engine import LLM, LoRARequest, SamplingParams
from serving.engine.models.llama import SUPPORTED_MODEL_TYPES

PROMPT = "Once upon a time there was a little house at the edge of the forest, and in it lived"
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_TOKENS = 12

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("arch", ["qwen3"])
def test_greedy_tokens_match_peft(arch: str, tiny_model_factory: Callable[..., Path],
                                  make_adapter: Callable[..., Path]) -> None:
    base = tiny_model_factory(arch)
    adapter = make_adapter(base, r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS, seed=7, init_scale=0.5)
    llm = LLM(str(base), max_loras=1, max_lora_rank=8, device="cpu", max_model_len=128, block_size=4,
              num_kv_blocks=64)
    ids = llm.get_tokenizer()(PROMPT).input_ids
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = PeftReference(base, {"ad": adapter})
    base_out = llm.generate({"prompt_token_ids": ids}, greedy)[0].outputs[0].token_ids
    lora_out = llm.generate({"prompt_token_ids": ids}, greedy, lora_request=LoRARequest("ad", str(adapter)))[0]
    assert_greedy_match(base_out, reference.generate(ids, None, MAX_TOKENS), f"{arch} base")
    assert_greedy_match(lora_out.outputs[0].token_ids, reference.generate(ids, "ad", MAX_TOKENS), f"{arch} + adapter")
    assert lora_out.outputs[0].token_ids != base_out  # the adapter is really applied


def test_an_unsupported_architecture_is_refused_naming_the_supported(tiny_llama_dir: Path, tmp_path: Path) -> None:
    other = shutil.copytree(tiny_llama_dir, tmp_path / "phi")
    config = json.loads((other / "config.json").read_text())
    config["model_type"] = "phi"
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"model_type 'phi' is not supported; the engine serves {', '.join(SUPPORTED_MODEL_TYPES)}"):
        LLM(str(other), max_loras=0, device="cpu")
    assert "qwen3" in SUPPORTED_MODEL_TYPES
