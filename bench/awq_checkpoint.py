"""A random AWQ INT4 checkpoint directory of a benchmark shape, for timing the INT4 base where no
real one is at hand (the device machine reaches no hub; ``load_format="dummy"`` makes bf16 weights
only). Config (with AWQ's ``quantization_config``), a tokenizer (any: benchmarks feed token ids) and
one safetensors file: embeddings, LM head and norms in bf16, every projection as ``qweight``,
``qzeros`` and ``scales`` in AutoAWQ's GEMM layout (kernels.int4) with random 4-bit weights,
zero points of 8 and scales that give the weights a standard deviation of about 0.02.

    python bench/awq_checkpoint.py OUT [--shape tiny|small|llama3-8b|llama3-70b] [--group-size 128] [--seed 0]

The 8B shape writes 5.7 GB. Serve it as any model directory (``LLM(OUT)``, the worker's ``--model``).

:func:`awq_quantization_config`, :func:`awq_layer` and :func:`save_awq_checkpoint` are the writer's
pieces, shared with bench/quantized_agreement.py, which writes a real model's weights (rounded to nearest)
in the same layout.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from bench.random_adapters import shape_config  # noqa: E402
from kernels.int4 import PACK, check_layout  # noqa: E402
from serving.engine.tiny import build_tiny_model  # noqa: E402

# A uniform 4-bit value minus 8 has a standard deviation of about 4.6: this scale makes it 0.02.
SCALE = 0.02 / 4.6


def awq_quantization_config(group_size: int) -> dict[str, object]:
    """The ``quantization_config`` AutoAWQ writes for a 4-bit GEMM checkpoint of ``group_size``."""
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}


def awq_layer(prefix: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              group_size: int) -> dict[str, torch.Tensor]:  # fmt: skip
    """One projection's tensors under the checkpoint's names (``{prefix}.qweight`` ...), checked to be
    one AWQ layer's."""
    check_layout(qweight, qzeros, scales, group_size)
    return {f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales}


def save_awq_checkpoint(out: Path, config: dict[str, object], tensors: dict[str, torch.Tensor], *, group_size: int,
                        files_from: Path, files: Iterable[str]) -> Path:  # fmt: skip
    """Write ``out`` (a new directory): ``config`` with AWQ's ``quantization_config``, ``tensors`` as
    one safetensors file, and ``files`` (tokenizer, chat template, ...) copied from ``files_from``
    where they exist; returns ``out``."""
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": awq_quantization_config(group_size)},
                                                indent=2))  # fmt: skip
    for name in files:
        if (files_from / name).exists():
            shutil.copy(files_from / name, out / name)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def write_random_awq(out: Path, shape: str, *, group_size: int, seed: int) -> Path:
    """Write the checkpoint of ``shape`` to ``out`` (a new directory); returns it."""
    # Any tokenizer will do (prompts are token ids); the tiny and small shapes take its model's config.
    tiny = build_tiny_model(Path(tempfile.mkdtemp()) / "model", arch="llama", size=shape if shape == "small" else "tiny")
    config = shape_config(shape)
    if shape in ("tiny", "small"):
        config = json.loads((tiny / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    generator = torch.Generator().manual_seed(seed)

    def dense(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=generator) * 0.02).to(torch.bfloat16)

    def awq(prefix: str, in_features: int, out_features: int) -> dict[str, torch.Tensor]:
        groups = in_features // group_size
        words = torch.randint(-(2**31), 2**31, (in_features, out_features // PACK), generator=generator, dtype=torch.int64)
        return awq_layer(prefix, words.to(torch.int32),
                         torch.full((groups, out_features // PACK), 0x88888888 - 2**32, dtype=torch.int32),
                         torch.full((groups, out_features), SCALE, dtype=torch.float16), group_size)  # fmt: skip

    tensors = {"model.embed_tokens.weight": dense(config["vocab_size"], hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}  # fmt: skip
    if not config.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = dense(config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{layer}.{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        for name, fan_in, fan_out in (("self_attn.q_proj", hidden, heads * head_dim),
                                      ("self_attn.k_proj", hidden, kv_heads * head_dim),
                                      ("self_attn.v_proj", hidden, kv_heads * head_dim),
                                      ("self_attn.o_proj", heads * head_dim, hidden),
                                      ("mlp.gate_proj", hidden, inter), ("mlp.up_proj", hidden, inter),
                                      ("mlp.down_proj", inter, hidden)):  # fmt: skip
            tensors |= awq(f"{layer}.{name}", fan_in, fan_out)
    return save_awq_checkpoint(out, config, tensors, group_size=group_size, files_from=tiny,
                               files=("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_random_awq(args.out, args.shape, group_size=args.group_size, seed=args.seed))


if __name__ == "__main__":
    main()
