"""QLoRA benchmark (issue 41, item 3): peak memory and trained tokens/s of the platform's trainer on
the bf16 base against the same trainer on the INT4 base (a job's ``base_quantization: "int4"``,
training.int4_base), and against ``transformers.Trainer`` + PEFT + bitsandbytes (NF4, double
quantization, bf16 compute: the QLoRA recipe) where bitsandbytes imports on a CUDA device.

The shapes and data are bench/trainer.py's: ``--shape llama3-8b`` (CUDA) is the Llama-3-8B shape with
random bf16 weights made on the device, rank-16 LoRA on all projections, batches of ``--batch``
sequences of ``--seq-len`` random tokens, every token trained; ``--shape tiny`` is the tiny llama on
the CPU (fp32, the INT4 path's torch reference), a smoke run of the same code.

    python3 bench/qlora.py --shape llama3-8b [--steps 100] [--batch 4] [--seq-len 512] [--json OUT]

Each row runs with only its own base resident: the bf16 row first; then the same weights quantized
in place (each projection's bf16 weight freed as it is quantized) for the INT4 row; then, for the
bitsandbytes row, the random weights saved before quantizing are loaded by transformers with a
``BitsAndBytesConfig`` (the only way transformers builds a bitsandbytes model) after our model is
freed. bitsandbytes' row skips ``prepare_model_for_kbit_training`` (it would upcast the embeddings,
head and norms to fp32: more memory, not the recipe's essence) and takes the same gradient
checkpointing setting as ours. The memory model's prediction (training.memory_model) is printed
beside each of our rows' measured peak.

``--kernels`` (CUDA) times the INT4 projection's two products instead, at the 8B shape's projections
and ``--batch`` × ``--seq-len`` rows, each against cuBLAS on the bf16 weight: the forward by the
fused Triton dequant-GEMM (what the layer runs) and by the Triton dequantizer + cuBLAS; the input
gradient by the dequantizer + cuBLAS (what the layer runs) and by the fused transposed kernel
(``kernels.int4.matmul_t_triton``). ``triton.testing.do_bench`` medians; which path the layer takes
for each product follows from these.
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
from transformers import AutoModelForCausalLM  # noqa: E402

from bench.card import card  # noqa: E402
from bench.trainer import BIG_SHAPES, StepTimer, bench_base, peak_memory_gib, steady_tokens_per_s  # noqa: E402
from bench.trainer_hf import run_hf_trainer  # noqa: E402
from training.examples import EncodedExample  # noqa: E402
from training.hyperparameters import Hyperparameters  # noqa: E402
from training.int4_base import quantize_projections  # noqa: E402
from training.memory_model import GIB, PROJECTIONS, Setup, Shape, estimate  # noqa: E402
from training.trainer import LoadedBase, LoraTrainer, pick_device  # noqa: E402


def reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def ours(base: LoadedBase, hp: Hyperparameters, examples: list[EncodedExample], work_dir: Path, warmup_steps: int,
         compile_layers: bool | None) -> dict[str, float]:  # fmt: skip
    """Our trainer's figures on `base`: tokens/s after the warm-up, peak memory, first and last loss."""
    reset_peak(base.device)
    timer = StepTimer()
    start = time.perf_counter()
    LoraTrainer(base, hp, seed=0, train=examples, valid=[], hooks=timer, work_dir=work_dir, fingerprint="random",
                base_model_name="bench", checkpoint_every=10**9, log_every=10, compile_layers=compile_layers).run()
    return {"tokens_per_s": steady_tokens_per_s(timer, warmup_steps), "peak_memory_gib": peak_memory_gib(base.device),
            "total_s": time.perf_counter() - start, "first_loss": timer.losses[0], "last_loss": timer.losses[-1]}


# (name, in, out) of the 8B shape's projections as the trainer holds them (q, k, v apart; gate, up apart).
KERNEL_SHAPES = [("q_proj/o_proj", 4096, 4096), ("k_proj/v_proj", 4096, 1024), ("gate_proj/up_proj", 4096, 14336),
                 ("down_proj", 14336, 4096)]


def time_kernels(rows: int) -> list[dict[str, Any]]:
    """ms of each product of an INT4 projection at `rows` rows against cuBLAS on the bf16 weight (module docstring)."""
    from triton.testing import do_bench

    from kernels import int4

    timings = []
    generator = torch.Generator().manual_seed(0)
    for name, fan_in, fan_out in KERNEL_SHAPES:
        weight = torch.randn(fan_out, fan_in, generator=generator) * 0.02
        packed = tuple(tensor.cuda() for tensor in int4.quantize(weight, 128))
        dense = weight.to("cuda", torch.bfloat16).t()  # [in, out], as dequantize gives it
        x = torch.randn(rows, fan_in, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(rows, fan_out, device="cuda", dtype=torch.bfloat16)
        figures = {
            "forward_bf16": do_bench(lambda: x @ dense),
            "forward_fused": do_bench(lambda: int4.matmul_triton(x, *packed, 128)),
            "forward_dequantize_cublas": do_bench(lambda: x @ int4.dequantize_triton(*packed, 128, torch.bfloat16)),
            "backward_bf16": do_bench(lambda: dy @ dense.t()),
            "backward_dequantize_cublas": do_bench(
                lambda: dy @ int4.dequantize_triton(*packed, 128, torch.bfloat16).t()),
            "backward_fused": do_bench(lambda: int4.matmul_t_triton(dy, *packed, 128)),
            "dequantize": do_bench(lambda: int4.dequantize_triton(*packed, 128, torch.bfloat16)),
        }  # fmt: skip
        timings.append({"projection": f"{name} {fan_in}x{fan_out}", "rows": rows, **figures})
    return timings


def print_kernels(timings: list[dict[str, Any]]) -> None:
    columns = [key for key in timings[0] if key not in ("projection", "rows")]
    print("| projection | rows | " + " | ".join(f"{column} ms" for column in columns) + " |")
    print("|---|---:|" + "---:|" * len(columns))
    for row in timings:
        print(f"| {row['projection']} | {row['rows']} | " + " | ".join(f"{row[c]:.4f}" for c in columns) + " |")


def bitsandbytes_missing(device: torch.device) -> str | None:
    """Why the bitsandbytes row cannot run here; None when it can."""
    if device.type != "cuda":
        return "bitsandbytes' 4-bit layers need a CUDA device"
    try:
        import bitsandbytes  # noqa: F401
    except Exception as error:  # an import that fails for any reason (no wheel, no CUDA library) skips the row
        return f"bitsandbytes does not import: {type(error).__name__}: {error}"
    return None


def hf_bitsandbytes(checkpoint: Path, examples: list[EncodedExample], args: argparse.Namespace) -> dict[str, float]:
    """transformers.Trainer + PEFT over the checkpoint loaded in NF4 by bitsandbytes (bench/trainer_hf.py's run)."""
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=quantization, dtype=torch.bfloat16,
                                                 device_map={"": 0})
    model.eval().requires_grad_(False)
    figures = run_hf_trainer(model, examples, batch=args.batch, rank=args.rank, learning_rate=1e-4,
                             gradient_checkpointing=args.gradient_checkpointing, warmup_steps=args.warmup_steps)
    del model
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("tiny", *BIG_SHAPES), default="tiny")
    parser.add_argument("--num-layers", type=int, help="cut the shape's decoder layers to this many")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--warmup-steps", type=int, default=5, help="steps left out of the tokens/s")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--no-compile", action="store_true", help="our loop with eager decoder layers")
    parser.add_argument("--skip-bitsandbytes", action="store_true", help="leave the bitsandbytes row out")
    parser.add_argument("--kernels", action="store_true", help="time the INT4 products only (CUDA)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.steps <= args.warmup_steps:
        parser.error("--steps must be more than --warmup-steps")
    device = pick_device()
    if args.kernels:
        if device.type != "cuda":
            parser.error("--kernels times CUDA kernels: no CUDA device")
        timings = time_kernels(args.batch * args.seq_len)
        print(f"{torch.cuda.get_device_name(device)}; AWQ group 128; bf16")
        print_kernels(timings)
        if args.json:
            args.json.write_text(json.dumps({"kernels": timings, "card": card(device.index or 0)}, indent=2))
        return 0
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer, tiny = bench_base(args.shape, args.num_layers, device, Path(tmp), parser.error)
        config = model.config.to_dict()
        rng = random.Random(0)
        examples = []
        for _ in range(args.steps * args.batch):
            ids = [rng.randrange(3, model.config.vocab_size) for _ in range(args.seq_len)]
            examples.append(EncodedExample(input_ids=ids, labels=ids, full_length=args.seq_len, truncated=False))
        hp = Hyperparameters(n_epochs=1, batch_size=args.batch, learning_rate=1e-4, max_seq_length=args.seq_len,
                             r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                             gradient_checkpointing=args.gradient_checkpointing)  # fmt: skip
        compile_layers = False if args.no_compile else None
        base = LoadedBase(model=model, tokenizer=tokenizer, path=str(tiny), device=device)
        rows["bf16"] = ours(base, hp, examples, Path(tmp) / "bf16", args.warmup_steps, compile_layers)

        skipped = "--skip-bitsandbytes" if args.skip_bitsandbytes else bitsandbytes_missing(device)
        checkpoint = Path(tmp) / "random-base"
        if skipped is None:
            # The same random weights for bitsandbytes to quantize as it loads (before ours are quantized).
            model.save_pretrained(checkpoint, safe_serialization=True)

        start = time.perf_counter()
        quantized = quantize_projections(model, device)
        quantize_s = time.perf_counter() - start
        rows["int4"] = {**ours(base, replace(hp, base_quantization="int4"), examples, Path(tmp) / "int4",
                               args.warmup_steps, compile_layers), "quantize_s": quantize_s, "projections": quantized}
        del base, model
        reset_peak(device)

        if skipped is None:
            rows["hf_bitsandbytes_nf4"] = hf_bitsandbytes(checkpoint, examples, args)
        else:
            print(f"transformers.Trainer + PEFT + bitsandbytes: skipped ({skipped})")

    shape = Shape.from_config(config)
    setup = Setup(rank=args.rank, targets=PROJECTIONS, tokens=args.batch * args.seq_len,
                  gradient_checkpointing=args.gradient_checkpointing)
    if device.type == "cuda":
        rows["bf16"]["predicted_peak_gib"] = estimate(shape, setup).peak / GIB
        rows["int4"]["predicted_peak_gib"] = estimate(shape, replace(setup, int4_base=True)).peak / GIB
    results: dict[str, Any] = {
        "shape": args.shape, "num_layers": shape.layers,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "rank": args.rank,
        "gradient_checkpointing": args.gradient_checkpointing,
        "compiled_layers": not args.no_compile and device.type == "cuda", "rows": rows,
        "bitsandbytes_skipped": skipped,
    }  # fmt: skip
    for name, figures in rows.items():
        for key, value in figures.items():
            print(f"{name:22s} {key:20s} {value:.3f}" if isinstance(value, float) else f"{name:22s} {key:20s} {value}")
    bf16 = rows["bf16"]
    for name in rows.keys() - {"bf16"}:
        print(f"{name:22s} tokens/s vs bf16      {rows[name]['tokens_per_s'] / bf16['tokens_per_s']:.3f}")
        if device.type == "cuda":
            print(f"{name:22s} peak vs bf16          {rows[name]['peak_memory_gib'] / bf16['peak_memory_gib']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({**results, "card": card(device.index or 0)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
