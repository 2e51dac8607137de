"""Random PEFT adapters for the benchmarks: the model shapes they go on (the Llama-3-8B config),
their sizes, a fast bf16 writer (no PEFT: PEFT would build the model first), many written at once
in a process pool, and a directory of them kept across runs.

A set of adapters lives in ``<root>/<shape>-r<rank>-<modules>/a<i>``, adapter ``a<i>`` written with
seed ``i``: the first N of a larger set are the N-adapter set, so a 1,024-adapter run and a 32-adapter
run on the same root share 32 adapters, and a second run (another worker in the same device call)
writes none. Each adapter appears whole or not at all (written beside its place, then renamed), so
an interrupted write leaves nothing a later run would take for an adapter.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

# The Llama-3-8B shape the GPU benchmarks run (random weights: the worker's --load-format dummy).
LLAMA3_8B: dict[str, Any] = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    hidden_act="silu",
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
)
# The Llama-3-70B shape (bench/trainer_70b.py trains it cut to a few layers: its 80 take ~131 GiB in bf16).
LLAMA3_70B: dict[str, Any] = dict(
    LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
    num_key_value_heads=8,
)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MODULE_SETS: dict[str, tuple[str, ...]] = {"all": (*ATTENTION, "gate_proj", "up_proj", "down_proj"), "attn": ATTENTION}
# /dev/shm is used only with this much room to spare beside the adapters (other files, the worker).
_SHM_SPARE_BYTES = 2 * 2**30


def shape_config(shape: str) -> dict[str, Any]:
    """The model config of a benchmark shape: tiny, small (serving/engine/tiny.py), llama3-8b or llama3-70b."""
    if shape in ("tiny", "small"):
        from serving.engine.tiny import SIZES

        return dict(SIZES[shape])
    if shape == "llama3-8b":
        return dict(LLAMA3_8B)
    if shape == "llama3-70b":
        return dict(LLAMA3_70B)
    raise ValueError(f"shape must be tiny, small, llama3-8b or llama3-70b, got {shape!r}")


def lora_shapes(config: Mapping[str, Any], modules: Sequence[str]) -> dict[str, tuple[int, int]]:
    """(fan_in, fan_out) of each adapted projection of a Llama-shaped model's ``config``."""
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    kv = kv_heads * (hidden // heads)
    shapes = {
        "q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }  # fmt: skip
    unknown = set(modules) - set(shapes)
    if unknown:
        raise ValueError(f"no such projection(s): {sorted(unknown)}")
    return {m: shapes[m] for m in modules}


def adapter_bytes(config: Mapping[str, Any], rank: int, modules: Sequence[str], element_size: int = 2) -> int:
    """The tensor bytes of one rank-``rank`` adapter on ``modules`` of every layer (bf16: as written)."""
    per_layer = sum(rank * (fan_in + fan_out) for fan_in, fan_out in lora_shapes(config, modules).values())
    return per_layer * int(config["num_hidden_layers"]) * element_size


def write_random_adapter(
    out: Path, config: Mapping[str, Any], rank: int, seed: int, modules: Sequence[str] = MODULE_SETS["all"]
) -> Path:
    """A rank-``rank`` PEFT adapter on ``modules`` of every layer of a Llama-shaped ``config``, bf16,
    A ~ N(0, 1/fan_in) and B ~ N(0, 0.01²): visible in the output, far from swamping it."""
    import torch  # here, not above: the load generator imports this module for the sizes alone
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module, (fan_in, fan_out) in lora_shapes(config, modules).items():
            block = "self_attn" if module in ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=generator) / fan_in**0.5).bfloat16()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=generator) * 0.01).bfloat16()
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "bias": "none", "target_modules": list(modules), "base_model_name_or_path": None,
    }))  # fmt: skip
    return out


def _one_thread() -> None:
    """A pool process's torch runs on one thread: the pool is the parallelism."""
    import torch

    torch.set_num_threads(1)


def _write_one(out: Path, config: Mapping[str, Any], rank: int, seed: int, modules: tuple[str, ...]) -> None:
    """One adapter of a set, into a sibling first and renamed into place (a process pool's task)."""
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    write_random_adapter(partial, config, rank, seed, modules)
    try:
        partial.rename(out)
    except OSError:  # another run wrote it meanwhile: theirs is as good (same seed)
        if not out.is_dir():
            raise
        shutil.rmtree(partial)


def adapter_paths(root: Path, shape: str, *, count: int, rank: int, modules: str) -> list[Path]:
    """Where the first ``count`` adapters of the set for (shape, rank, modules) under ``root`` are
    (whether or not they are written yet)."""
    if count < 0 or rank < 1:
        raise ValueError(f"count must be >= 0 and rank >= 1, got count={count}, rank={rank}")
    if modules not in MODULE_SETS:
        raise ValueError(f"modules must be one of {sorted(MODULE_SETS)}, got {modules!r}")
    return [root / f"{shape}-r{rank}-{modules}" / f"a{i}" for i in range(count)]


def adapter_set(
    root: Path, shape: str, *, count: int, rank: int, modules: str, processes: int | None = None
) -> tuple[list[Path], int]:
    """The first ``count`` adapters of the set for (shape, rank, modules) under ``root``, writing the
    missing ones ``processes`` at a time (default: the CPU count). Returns the paths and how many
    were written now."""
    paths = adapter_paths(root, shape, count=count, rank=rank, modules=modules)
    missing = [i for i, path in enumerate(paths) if not path.is_dir()]
    workers = min(processes or os.cpu_count() or 1, len(missing))
    if workers:
        paths[0].parent.mkdir(parents=True, exist_ok=True)
        config = shape_config(shape)
        # spawn: the children start clean, not with a copy of this process's torch thread pools.
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_one_thread) as pool:
            jobs = [pool.submit(_write_one, paths[i], config, rank, i, MODULE_SETS[modules]) for i in missing]
            for job in jobs:
                job.result()
    return paths, len(missing)


def scratch_root(need_bytes: int) -> Path | None:
    """/dev/shm when it has room for ``need_bytes`` and a margin, else None (the system's temp
    directory): a RAM disk makes the worker's adapter reads cheap, but a full one fails writes."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free >= need_bytes + _SHM_SPARE_BYTES:
        return shm
    return None


def temporary_root(need_bytes: int, prefix: str) -> tempfile.TemporaryDirectory[str]:
    """A temporary directory for ``need_bytes`` of adapters, on /dev/shm where it has room."""
    root = scratch_root(need_bytes)
    return tempfile.TemporaryDirectory(prefix=prefix, dir=root)
