"""What bench/engine.py measures the engine against: transformers' and PEFT's own forward passes
(one-token decode steps over a KV cache on CPU; targets.md's no-cache reference batch on CUDA)."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch


@torch.no_grad()
def hf_decode_step_ms(model: torch.nn.Module, ids: torch.Tensor, steps: int, **kwargs: object) -> float:
    """Median time of one-token forwards over a KV cache of the prompt (transformers / PEFT)."""
    out = model(input_ids=ids, use_cache=True, **kwargs)
    cache = out.past_key_values
    token = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps + 3):
        start = time.perf_counter()
        out = model(input_ids=token, past_key_values=cache, use_cache=True, **kwargs)
        times.append(time.perf_counter() - start)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return statistics.median(times[3:]) * 1e3


@torch.no_grad()
def peft_forward_ms(model_dir: Path, adapters: list[Path], args: argparse.Namespace) -> dict[str, float]:
    """PEFT's mixed batch (``adapter_names=``) on transformers' model, batch of one token each, no KV
    cache, for 8 and for all the adapters (targets.md's reference measurement)."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    peft = PeftModel.from_pretrained(model, str(adapters[0]), adapter_name="p0", torch_device=args.device)
    for i, path in enumerate(adapters[1:], 1):
        peft.load_adapter(str(path), adapter_name=f"p{i}", torch_device=args.device)
    peft.eval()
    ids = torch.randint(3, config.vocab_size, (args.batch, 1), device=args.device)
    results = {}
    for count in sorted({min(8, len(adapters)), len(adapters)}):
        names = [f"p{i % count}" for i in range(args.batch)]
        times = []
        for _ in range(4):
            torch.cuda.synchronize()
            start = time.perf_counter()
            peft(input_ids=ids, adapter_names=names)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        results[f"peft_mixed_{count}_forward_ms"] = statistics.median(times[1:]) * 1e3
    return results


@torch.no_grad()
def transformers_forward_ms(model_dir: Path, args: argparse.Namespace) -> float:
    """transformers' own base model, random bf16 weights: one token per sequence, no KV cache
    (the measurement of targets.md's reference point)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.randint(3, config.vocab_size, (args.batch, 1), device=args.device)
    times = []
    for _ in range(args.steps + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(input_ids=ids)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) * 1e3
