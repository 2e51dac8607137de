"""The tiny-model builder: deterministic files, loadable by transformers, a working tokenizer."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from serving.engine.tiny import (
    ALL_ARCHS,
    SPECIAL_TOKENS,
    build_tiny_model,
    main,
    save_random_peft_adapter,
)
from tests import zygote

REPO_ROOT = Path(__file__).resolve().parents[2]


def digests(directory: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
    }


@pytest.mark.parametrize("arch", ALL_ARCHS)
@pytest.mark.slow
def test_same_seed_gives_identical_files_and_other_seed_other_weights(arch, tmp_path):
    first = digests(build_tiny_model(tmp_path / "a", arch=arch, seed=7))
    second = digests(build_tiny_model(tmp_path / "b", arch=arch, seed=7))
    other = digests(build_tiny_model(tmp_path / "c", arch=arch, seed=8))

    assert first == second
    expected = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert expected <= set(first)
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]


@pytest.mark.e2e
def test_command_line_builds_the_same_model_in_another_process(tmp_path, tiny_model_factory):
    """`python -m serving.engine.tiny` in a process of its own, forked from the zygote (tests/zygote.py:
    `python -m` run as a cold interpreter runs it, without paying torch's and transformers' imports
    again, 5 s of CPU cold); its output goes to files, as the zygote takes descriptors, not pipes."""
    out = tmp_path / "cli-model"
    with (tmp_path / "stdout").open("wb") as stdout, (tmp_path / "stderr").open("wb") as stderr:
        process = zygote.popen([sys.executable, "-m", "serving.engine.tiny", str(out), "--arch", "qwen2", "--seed", "0"],
                               cwd=REPO_ROOT, stdout=stdout, stderr=stderr)
        returncode = process.wait(timeout=300)

    assert returncode == 0, (tmp_path / "stderr").read_text()
    assert "qwen2 tiny" in (tmp_path / "stdout").read_text()
    assert digests(out) == digests(tiny_model_factory("qwen2"))


def test_command_line_refuses_an_existing_directory(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")

    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path)])

    assert exit_info.value.code == 2
    assert "already exists" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_existing_directory_is_refused_unless_overwrite(tmp_path, tiny_llama_dir):
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.txt").write_text("old build")

    with pytest.raises(FileExistsError, match="already exists"):
        build_tiny_model(out, arch="mistral")
    assert [p.name for p in out.iterdir()] == ["stale.txt"]

    build_tiny_model(out, arch="llama", overwrite=True)
    assert digests(out) == digests(tiny_llama_dir)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


@pytest.mark.parametrize("kwargs", [{"arch": "gpt2"}, {"size": "huge"}])
def test_unknown_arch_or_size_is_refused(tmp_path, kwargs):
    with pytest.raises(ValueError, match="unknown (arch|size)"):
        build_tiny_model(tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists()


def test_model_loads_with_its_architecture_shapes_and_vocabulary(tiny_model_dir):
    config = AutoConfig.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)

    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.vocab_size == len(tokenizer) == 512
    attention = model.model.layers[0].self_attn
    # Qwen3's heads are wider than hidden_size / heads, as in its real configs.
    assert attention.head_dim == (32 if config.model_type == "qwen3" else 16)
    assert attention.k_proj.weight.shape == (2 * attention.head_dim, 64)
    has_qkv_bias = config.model_type == "qwen2"
    assert all(
        (getattr(attention, name).bias is not None) == has_qkv_bias
        for name in ("q_proj", "k_proj", "v_proj")
    )
    assert attention.o_proj.bias is None

    ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config.vocab_size)
    assert torch.isfinite(logits).all()


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=80))
def test_tokenizer_round_trips_any_text(tiny_llama_dir, text):
    tokenizer = _tokenizer(tiny_llama_dir)
    ids = tokenizer(text).input_ids

    assert ids[0] == tokenizer.bos_token_id
    assert max(ids) < len(tokenizer)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_has_distinct_special_tokens_and_merges_common_words(tiny_llama_dir):
    tokenizer = _tokenizer(tiny_llama_dir)

    ids = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    assert len(set(ids)) == 3
    assert set(SPECIAL_TOKENS) <= set(tokenizer.all_special_tokens)
    assert len(tokenizer(" the", add_special_tokens=False).input_ids) == 1


def test_chat_template_renders_chatml_and_marks_assistant_tokens(tiny_llama_dir):
    tokenizer = _tokenizer(tiny_llama_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
    ]

    text = tokenizer.apply_chat_template(messages, tokenize=False)
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    encoded = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )

    assert text == (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    )
    assert prompt == text[: text.index("Hello!")]
    ids, mask = encoded["input_ids"], encoded["assistant_masks"]
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "Hello!<|im_end|>"


@pytest.mark.slow
def test_random_peft_adapter_is_seeded_non_zero_and_changes_the_output(
    tiny_model_dir, make_adapter
):
    first = make_adapter(tiny_model_dir, r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    again = make_adapter(tiny_model_dir, r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    other = make_adapter(tiny_model_dir, r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                         seed=1)

    tensors = load_file(first / "adapter_model.safetensors")
    assert len(tensors) == 2 * 2 * 2  # layers × modules × (A, B)
    assert all(t.abs().sum() > 0 for t in tensors.values())
    weights = "adapter_model.safetensors"
    assert digests(first)[weights] == digests(again)[weights]
    assert digests(first)[weights] != digests(other)[weights]
    config = json.loads((first / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj"]

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    with torch.no_grad():
        base_logits = base(ids).logits
        adapted_logits = PeftModel.from_pretrained(base, first)(ids).logits
    assert (adapted_logits - base_logits).abs().max() > 1e-3


def test_random_peft_adapter_can_name_another_base(tiny_llama_dir, tmp_path):
    out = save_random_peft_adapter(
        tiny_llama_dir, tmp_path / "a", r=2, lora_alpha=2, target_modules=["v_proj"], seed=0,
        base_model_name_or_path="org/other-model",
    )

    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        "org/other-model"
    )


_TOKENIZERS: dict[Path, object] = {}


def _tokenizer(model_dir: Path):
    """Hypothesis calls the test many times; load the tokenizer once per directory."""
    if model_dir not in _TOKENIZERS:
        _TOKENIZERS[model_dir] = AutoTokenizer.from_pretrained(model_dir)
    return _TOKENIZERS[model_dir]
