"""The design seed's table 7.1 for the Llama-3-8B shape, from the engine's own model and memory plan:
base weights in bf16 and as an AWQ INT4 checkpoint (group 128), and the adapter pool that holds 32
rank-16 adapters, on CPU, no weights made (the model is built on the meta device).

- weights: every parameter of the engine's model as built for the shape (``build_model``; with an
  AWQ ``quantization_config`` its projections hold ``qweight``, ``qzeros`` and ``scales``);
- adapters: ``serving.engine.memory_plan.plan_memory`` with ``max_loras=32, max_lora_rank=16``
  (a pool of rank rows, each costing every projection's A row and B column, as the model runner
  counts it), so a rank-16 adapter costs the same whatever modules it targets;
- the KV cache per token (bf16), for what the rest of a device holds.

With ``--cuda`` it also builds each base's model on the CUDA device and prints what the allocator
holds for it (``torch.cuda.memory_allocated`` before and after the build): the table's weights
column as the GPU has them, allocator rounding included.

    python bench/quantized_memory.py [--group-size 128] [--adapters 32] [--rank 16] [--cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from bench.random_adapters import LLAMA3_8B  # noqa: E402
from serving.engine.config import EngineConfig  # noqa: E402
from serving.engine.memory_plan import plan_memory  # noqa: E402
from serving.engine.models import build_model  # noqa: E402

GB = 1e9


def model_bytes(config: LlamaConfig) -> tuple[int, int]:
    """``(all weights, the projections' part)`` in bytes of the engine's model for ``config`` (bf16)."""
    model = build_model(config, max_positions=64, device=torch.device("meta"), dtype=torch.bfloat16)
    projections = {id(p) for layer in model.lora_layers() for p in layer.parameters() if p is not layer.bias}
    total = part = 0
    for param in model.parameters():
        size = param.numel() * param.element_size()
        total += size
        part += size if id(param) in projections else 0
    return total, part


def cuda_model_bytes(config: LlamaConfig) -> int:
    """Bytes the CUDA allocator holds for the engine's model of ``config`` built on the device."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = build_model(config, max_positions=64, device=torch.device("cuda"), dtype=torch.bfloat16)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    del model
    torch.cuda.empty_cache()
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--adapters", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--cuda", action="store_true", help="also measure each base's weights on the CUDA device")
    args = parser.parse_args()
    if args.cuda and not torch.cuda.is_available():
        raise SystemExit("--cuda: no CUDA device")
    awq = {"quant_method": "awq", "bits": 4, "group_size": args.group_size, "zero_point": True, "version": "gemm"}
    bf16_total, bf16_proj = model_bytes(LlamaConfig(**LLAMA3_8B))
    int4_total, int4_proj = model_bytes(LlamaConfig(**LLAMA3_8B, quantization_config=awq))
    model = build_model(LlamaConfig(**LLAMA3_8B), max_positions=64, device=torch.device("meta"), dtype=torch.bfloat16)
    row_bytes = sum(layer.row_elements for layer in model.lora_layers()) * torch.bfloat16.itemsize
    attn = model.attention_layers()
    kv_token_bytes = 2 * len(attn) * attn[0].num_kv_heads * attn[0].head_dim * torch.bfloat16.itemsize
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(LLAMA3_8B))
        config = EngineConfig(model=model_dir, device="cpu", max_loras=args.adapters, max_lora_rank=args.rank,
                              num_kv_blocks=1)  # fmt: skip
        plan = plan_memory(config, kv_block_bytes=kv_token_bytes * config.block_size, lora_row_bytes=row_bytes,
                           max_model_len=8192, budget=None)  # fmt: skip
    pool = plan.lora_rows * row_bytes
    print(f"Llama-3-8B shape; AWQ group {args.group_size}; {args.adapters} adapters of rank {args.rank} "
          f"({plan.lora_rows} pool rows of {row_bytes / 2**20:.2f} MiB)")  # fmt: skip
    print("| base | projections | embeddings + head + norms | weights | adapter pool | per adapter | total |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, total, proj in (("bf16", bf16_total, bf16_proj), (f"AWQ INT4 (g{args.group_size})", int4_total, int4_proj)):
        print(f"| {name} | {proj / GB:.2f} GB | {(total - proj) / GB:.2f} GB | {total / GB:.2f} GB | {pool / GB:.2f} GB "
              f"| {pool / args.adapters / 2**20:.0f} MiB | {(total + pool) / GB:.2f} GB |")  # fmt: skip
    if args.cuda:
        for name, config in (("bf16", LlamaConfig(**LLAMA3_8B)),
                             (f"AWQ INT4 (g{args.group_size})", LlamaConfig(**LLAMA3_8B, quantization_config=awq))):
            print(f"{name}: weights on {torch.cuda.get_device_name()}: {cuda_model_bytes(config) / GB:.2f} GB allocated")
    print(f"KV cache: {kv_token_bytes / 2**10:.0f} KiB a token (bf16); the INT4 base leaves "
          f"{(bf16_total - int4_total) / GB:.2f} GB more for it, {(bf16_total - int4_total) / kv_token_bytes:,.0f} tokens")


if __name__ == "__main__":
    main()
