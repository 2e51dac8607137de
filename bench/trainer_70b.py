"""The Llama-3-70B shape trained with gradient checkpointing, cut to a few layer counts, against the
memory model (training/memory_model.py) that predicts the whole 80 layers (issue 25).

For each ``--layers`` count: the 70B shape cut to that many decoder layers, random bf16 weights made
on the GPU directly, trained by `training.trainer.LoraTrainer` as a job runs it (rank ``--rank`` on
all seven projections, LoRA in fp32, batches of ``--batch`` × ``--seq-len`` random tokens, gradient
checkpointing unless ``--no-checkpointing``) for ``--steps`` steps: peak memory
(`torch.cuda.max_memory_allocated`, from after the build) and tokens/s (after ``--warmup-steps``)
beside the model's prediction. A count the model predicts over 92 % of the GPU is skipped. Then a
line fitted through the measured peaks, the model's per-layer slope and intercept, and both
extrapolated to 80 layers; whether that fits one GPU (and the longest micro-batch that would), and
the model's per-GPU peak with FSDP sharding the frozen base (training.distributed) over 2, 4 and 8
GPUs.

    python3 bench/trainer_70b.py [--layers 2,8,32,64] [--steps 4] [--seq-len 2048] [--json OUT]
    python3 bench/trainer_70b.py --shape tiny --layers 1,2 --steps 3   # the CPU smoke run, same code

``--shape tiny`` is the tiny llama (serving/engine/tiny.py) in fp32 on the CPU: the same loop and
the same prediction; the CPU has no allocator peak to read, so its measured figures are absent.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

# Run as a script, this file's folder heads sys.path; the repository root must be there instead.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from bench.card import card  # noqa: E402
from bench.random_adapters import LLAMA3_70B  # noqa: E402
from bench.trainer import StepTimer, build_on_device  # noqa: E402
from training.memory_model import GIB, PROJECTIONS, Setup, Shape, estimate, fit_line, fsdp_peak  # noqa: E402
from serving.engine.tiny import build_tiny_model  # noqa: E402
from training.examples import EncodedExample  # noqa: E402
from training.hyperparameters import Hyperparameters  # noqa: E402
from training.trainer import LoadedBase, LoraTrainer, load_tokenizer, pick_device  # noqa: E402

FSDP_GPUS = (2, 4, 8)
# A cut whose predicted peak is over this share of the GPU is not tried (the model may be off by a few %).
TRY_SHARE = 0.92
# The CPU smoke run's budget for "fits": 139 GiB, the H200's usable memory.
H200_BYTES = 139 * GIB
# Left out of the GPU for `max_tokens_one_gpu`: the CUDA context and the allocator's rounding, which
# max_memory_allocated does not count.
CONTEXT_RESERVE = 1 * GIB
TOKEN_STEP = 128


def train_cut(config: dict[str, Any], layers: int, setup: Setup, args: argparse.Namespace,
              base_path: str, device: torch.device, work: Path) -> dict[str, Any]:
    """One cut of the shape trained for a few steps: its measured peak and tokens/s."""
    cuda = device.type == "cuda"
    started = time.perf_counter()
    model = build_on_device(config, layers, device)
    if cuda:
        torch.cuda.synchronize(device)
    build_s = time.perf_counter() - started
    resident = torch.cuda.memory_allocated(device) if cuda else None
    rng = random.Random(layers)
    vocab = int(config["vocab_size"])
    examples = []
    for _ in range(args.steps * args.batch):
        ids = [rng.randrange(3, vocab) for _ in range(args.seq_len)]
        examples.append(EncodedExample(input_ids=ids, labels=ids, full_length=args.seq_len, truncated=False))
    hp = Hyperparameters(n_epochs=1, batch_size=args.batch, learning_rate=1e-4, max_seq_length=args.seq_len,
                         r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                         gradient_checkpointing=setup.gradient_checkpointing)  # fmt: skip
    timer = StepTimer()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    base = LoadedBase(model=model, tokenizer=load_tokenizer(base_path), path=base_path, device=device)
    LoraTrainer(base, hp, seed=0, train=examples, valid=[], hooks=timer, work_dir=work / f"job-{layers}",
                fingerprint="random", base_model_name=args.shape, checkpoint_every=10**9, log_every=1).run()
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    del base, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    (t0, tokens0), (t1, tokens1) = timer.stamps[args.warmup_steps - 1], timer.stamps[-1]
    return {"build_s": build_s, "measured_peak_gib": None if peak is None else peak / GIB,
            "measured_base_gib": None if resident is None else resident / GIB,
            "tokens_per_s": (tokens1 - tokens0) / (t1 - t0),
            "step_ms": (t1 - t0) / (len(timer.stamps) - args.warmup_steps) * 1e3,
            "first_loss": timer.losses[0], "last_loss": timer.losses[-1]}


def full_shape_report(config: dict[str, Any], setup: Setup, capacity: int,
                      measured: list[tuple[float, float]]) -> dict[str, Any]:
    """The model's full-depth prediction (and the measured line's, with two cuts or more), its fit on
    one GPU and the FSDP per-GPU peaks."""
    full = Shape.from_config(config)
    whole = estimate(full, setup)
    slope = (estimate(Shape.from_config(config, 2), setup).peak - estimate(Shape.from_config(config, 1), setup).peak)
    fitting = [tokens for tokens in range(TOKEN_STEP, 16 * 1024 + 1, TOKEN_STEP)
               if estimate(full, replace(setup, tokens=tokens)).peak <= capacity - CONTEXT_RESERVE]
    report: dict[str, Any] = {
        "layers": full.layers, "params": full.params, "predicted": whole.to_dict(),
        "model_intercept_gib": (whole.peak - full.layers * slope) / GIB, "model_slope_gib_per_layer": slope / GIB,
        "capacity_gib": capacity / GIB, "fits_one_gpu": whole.peak <= capacity,
        "max_tokens_one_gpu": max(fitting, default=0),
        "fsdp_per_gpu_gib": {str(n): fsdp_peak(full, setup, n) / GIB for n in FSDP_GPUS},
    }
    if len(measured) >= 2:
        intercept, measured_slope = fit_line(measured)
        report.update({"measured_intercept_gib": intercept, "measured_slope_gib_per_layer": measured_slope,
                       "measured_line_at_full_gib": intercept + measured_slope * full.layers})
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("tiny", "llama3-70b"), default="llama3-70b")
    parser.add_argument("--layers", default="2,8,32,64", help="comma-separated decoder layer counts to train")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup-steps", type=int, default=1, help="steps left out of the tokens/s")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--no-checkpointing", action="store_true", help="train without gradient checkpointing")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.steps <= args.warmup_steps:
        parser.error("--steps must be more than --warmup-steps")
    device = pick_device()
    cuda = device.type == "cuda"
    if args.shape == "llama3-70b" and not cuda:
        parser.error("--shape llama3-70b needs a CUDA device (--shape tiny runs the same code on the CPU)")
    counts = [int(part) for part in args.layers.split(",")]
    element = 2 if cuda else 4
    setup = Setup(rank=args.rank, targets=PROJECTIONS, tokens=args.batch * args.seq_len, base_bytes=element,
                  activation_bytes=element, gradient_checkpointing=not args.no_checkpointing,
                  workspace=Setup().workspace if cuda else 0)
    capacity = torch.cuda.get_device_properties(device).total_memory if cuda else H200_BYTES
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(Path(tmp) / "tiny", arch="llama", size="tiny")
        config = dict(LLAMA3_70B) if args.shape == "llama3-70b" else AutoConfig.from_pretrained(tiny).to_dict()
        for layers in counts:
            predicted = estimate(Shape.from_config(config, layers), setup)
            row: dict[str, Any] = {"layers": layers, "predicted": predicted.to_dict()}
            if predicted.peak > TRY_SHARE * capacity:
                row["skipped"] = f"predicted {predicted.peak / GIB:.1f} GiB > {TRY_SHARE:.0%} of the GPU"
            else:
                row.update(train_cut(config, layers, setup, args, str(tiny), device, Path(tmp)))
                if row["measured_peak_gib"] is not None:
                    row["measured_over_predicted"] = row["measured_peak_gib"] * GIB / predicted.peak
            runs.append(row)
            print(json.dumps({key: value for key, value in row.items() if key != "predicted"}
                             | {"predicted_peak_gib": predicted.peak / GIB}), flush=True)
    measured = [(float(row["layers"]), row["measured_peak_gib"]) for row in runs if row.get("measured_peak_gib")]
    results = {
        "shape": args.shape, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__, "batch": args.batch, "seq_len": args.seq_len, "rank": args.rank,
        "targets": list(PROJECTIONS), "gradient_checkpointing": setup.gradient_checkpointing, "steps": args.steps,
        "runs": runs, "full": full_shape_report(config, setup, capacity, measured),
    }  # fmt: skip
    full = results["full"]
    print(f"full {full['layers']} layers ({full['params'] / 1e9:.2f} B params): predicted peak "
          f"{full['predicted']['peak_gib']:.1f} GiB of {full['capacity_gib']:.1f} GiB "
          f"({'fits' if full['fits_one_gpu'] else 'does not fit'} one GPU)"
          + (f"; measured line at {full['layers']} layers {full['measured_line_at_full_gib']:.1f} GiB"
             if "measured_line_at_full_gib" in full else ""))
    print(f"one GPU holds the full shape's step up to {full['max_tokens_one_gpu']} tokens a micro-batch "
          f"({CONTEXT_RESERVE / GIB:.0f} GiB left for the CUDA context)")
    print("FSDP per GPU: " + ", ".join(f"{n} GPUs {gib:.1f} GiB" for n, gib in full["fsdp_per_gpu_gib"].items()))
    if args.json:
        args.json.write_text(json.dumps({**results, "card": card(device.index or 0)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
