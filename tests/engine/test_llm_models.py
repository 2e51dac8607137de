"""Architecture details the mixed-batch test does not reach: sliding-window attention (Mistral),
tied embeddings (small Qwen2 models), and refusing checkpoints the engine cannot load."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from peft_reference import PeftReference, assert_greedy_match
from safetensors.torch import load_file, save_file

from serving.engine import LLM, SamplingParams

PROMPT = "Once upon a time there was a little house at the edge of the forest, and in it lived"


pytestmark = pytest.mark.usefixtures("one_thread")


def _variant(source: Path, dest: Path, edit_config: Callable[[dict], None], edit_weights=None) -> Path:
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    edit_config(config)
    (dest / "config.json").write_text(json.dumps(config))
    if edit_weights is not None:
        weights = load_file(dest / "model.safetensors")
        edit_weights(weights)
        save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def _check_against_hf(model_dir: Path, **engine_args: object) -> None:
    llm = LLM(str(model_dir), max_loras=0, device="cpu", max_model_len=128, block_size=4, num_kv_blocks=64, **engine_args)
    ids = llm.get_tokenizer()(PROMPT).input_ids
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert_greedy_match(out.outputs[0].token_ids, PeftReference(model_dir, {}).generate(ids, None, 16), model_dir.name)


def test_sliding_window_attention(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    def window(config: dict) -> None:
        config["sliding_window"] = 8

    model_dir = _variant(tiny_model_factory("mistral"), tmp_path / "mistral-window", window)
    assert len(PROMPT.split()) > 8
    _check_against_hf(model_dir, max_num_batched_tokens=6)  # chunks straddle the window too


def test_tied_embeddings(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    def tie(config: dict) -> None:
        config["tie_word_embeddings"] = True

    model_dir = _variant(tiny_model_factory("qwen2"), tmp_path / "qwen2-tied", tie, lambda w: w.pop("lm_head.weight"))
    _check_against_hf(model_dir)


def test_unloadable_checkpoints_are_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    missing = _variant(tiny_llama_dir, tmp_path / "missing", lambda c: None, lambda w: w.pop("model.norm.weight"))
    with pytest.raises(ValueError, match="lacks 1 weights, e.g. \\['model.norm.weight'\\]"):
        LLM(str(missing), max_loras=0, device="cpu")
    pickled = shutil.copytree(tiny_llama_dir, tmp_path / "pickled")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match="no \\*.safetensors weights .*pickled checkpoints are never loaded"):
        LLM(str(pickled), max_loras=0, device="cpu")

    def gpt2(config: dict) -> None:
        config["model_type"] = "gpt2"

    other = _variant(tiny_llama_dir, tmp_path / "other", gpt2)
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        LLM(str(other), max_loras=0, device="cpu")
    with pytest.raises(ValueError, match="not a directory"):
        LLM(str(tmp_path / "nowhere"), max_loras=0)
