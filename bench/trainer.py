"""Trainer benchmark: the platform's LoRA trainer (``training.trainer.LoraTrainer``, as a job runs it)
for a number of steps on random data, reporting trained tokens/s and peak GPU memory.

``--shape llama3-8b`` (CUDA): the Llama-3-8B shape with random bf16 weights made on the device (the
trainer's CUDA path: bf16 base, LoRA weights in fp32 through PEFT's autocast), rank-16 adapters on
all linear projections, batches of ``--batch`` sequences of ``--seq-len`` random tokens, every token
trained. ``--shape tiny``: the tiny llama on the CPU (fp32), a smoke run of the same code. ``--shape llama3-70b``
(CUDA) is the Llama-3-70B shape, and ``--num-layers N`` cuts any shape to N decoder layers
(bench/trainer_70b.py runs the 70B shape at several cuts against the memory model).

    python3 bench/trainer.py --shape llama3-8b [--steps 300] [--batch 4] [--seq-len 512] [--json OUT]

The trainer's options: ``--accumulation K`` (micro-batches a step), ``--gradient-checkpointing``,
``--packing`` (random sequences of ``--seq-len`` // 4 tokens, packed four to a row of ``--seq-len``).
``--compare`` then runs Hugging Face's ``transformers.Trainer`` + PEFT on the same base, data, rank,
batch and precision in the same process (bench/trainer_hf.py; its rows are the unpacked sequences)
and prints both sides' tokens/s and peak memory and their ratio: the measurement issue 25 asks
for to choose between our loop and TRL's (TRL's SFTTrainer is transformers.Trainer underneath).
``--ablate`` also runs our loop without its speed-ups, one at a time (compiled decoder layers,
training.compiled_layers; packed rows attended by their bounds, training.packed_attention), to
show what each is worth. ``--profile FILE`` runs torch.profiler over three steps of our loop after
the warm-up and writes its kernel table (by device time, then by CPU time) to FILE: where a step's
time goes.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

# Run as a script, this file's folder heads sys.path; the repository root must be there instead.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from bench.card import card  # noqa: E402
from bench.profiles import write_profile  # noqa: E402
from bench.random_adapters import LLAMA3_8B, LLAMA3_70B  # noqa: E402
from bench.trainer_hf import run_hf_trainer  # noqa: E402
from serving.engine.tiny import build_tiny_model  # noqa: E402
from training.examples import EncodedExample  # noqa: E402
from training.hyperparameters import Hyperparameters  # noqa: E402
from training.trainer import LoadedBase, LoraTrainer, StepMetrics, load_tokenizer, pick_device  # noqa: E402


BIG_SHAPES = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B}


def build_on_device(config: dict[str, Any], num_layers: int | None, device: torch.device) -> Any:
    """A Llama of `config` (cut to `num_layers` decoder layers) with random weights made on `device`
    directly, frozen: bf16 on CUDA, fp32 on the CPU."""
    layers = config["num_hidden_layers"] if num_layers is None else num_layers
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**dict(config, num_hidden_layers=layers)), dtype=dtype)
    return model.eval().requires_grad_(False)


def bench_base(shape: str, num_layers: int | None, device: torch.device, directory: Path,
               error: Callable[[str], Any]) -> tuple[Any, Any, Path]:
    """`(model, tokenizer, tiny)`: the frozen model of `shape` (the 8B/70B shapes with random weights on
    CUDA, cut to `num_layers`; "tiny": the suite's tiny Llama written under `directory`) and the tiny
    model's tokenizer (benchmarks feed token ids), which `error` refuses a big shape without CUDA."""
    tiny = build_tiny_model(directory / "tiny", arch="llama", size="tiny")
    tokenizer = load_tokenizer(str(tiny))
    if shape in BIG_SHAPES:
        if device.type != "cuda":
            error(f"--shape {shape} needs a CUDA device")
        return build_on_device(BIG_SHAPES[shape], num_layers, device), tokenizer, tiny
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    overrides = {} if num_layers is None else {"num_hidden_layers": num_layers}
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=dtype, **overrides).to(device)
    return model.eval().requires_grad_(False), tokenizer, tiny


class StepTimer:
    """Training hooks that stamp each step, so the first steps (allocator and kernel warm-up) can be left out.

    The trainer's host runs ahead of the GPU (a step reads nothing off it), so a stamp is only the
    GPU's time where the stream has been waited for: at ``sync_steps``, the steps whose stamps a
    figure divides by (:func:`steady_tokens_per_s`). Waiting at every step would stall the loop where
    training does not."""

    def __init__(self, sync_steps: Collection[int] = ()) -> None:
        self.stamps: list[tuple[float, int]] = []
        self.losses: list[float] = []
        self.sync_steps = frozenset(sync_steps)

    def should_stop(self) -> bool:
        return False

    def on_step(self, step: int, total_steps: int, epoch: float, trained_tokens: int) -> None:
        if step in self.sync_steps and torch.cuda.is_available():
            torch.cuda.synchronize()
        self.stamps.append((time.perf_counter(), trained_tokens))

    def on_log(self, metrics: StepMetrics) -> None:
        self.losses.append(metrics.train_loss)

    def on_checkpoint(self, step: int, directory: Path, metrics: dict[str, object]) -> None:
        pass


class ProfilingTimer(StepTimer):
    """A StepTimer that runs torch.profiler over `steps` steps after the first `start` and writes the
    kernel table to `out` when they are done."""

    def __init__(self, out: Path, start: int, steps: int = 3, sync_steps: Collection[int] = ()) -> None:
        super().__init__(sync_steps)
        self.out, self.start, self.steps = out, start, steps
        self._profiler: Any = None
        self._began = 0.0

    def on_step(self, step: int, total_steps: int, epoch: float, trained_tokens: int) -> None:
        super().on_step(step, total_steps, epoch, trained_tokens)
        done = len(self.stamps)
        if done == self.start:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._profiler = profile(activities=activities)
            self._profiler.start()
            self._began = time.perf_counter()
        elif self._profiler is not None and done == self.start + self.steps:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - self._began) / self.steps * 1e3
            self._profiler.stop()
            device_ms = write_profile(self._profiler, self.out, self.steps, wall_ms, rows=30)
            print(f"profile {self.out}: device busy {device_ms:.2f} ms per step of {wall_ms:.2f} ms")
            self._profiler = None


def steady_tokens_per_s(timer: StepTimer, warmup_steps: int) -> float:
    """Trained tokens a second after the first `warmup_steps` (allocator warm-up, compilation)."""
    (t0, tokens0), (t1, tokens1) = timer.stamps[warmup_steps - 1], timer.stamps[-1]
    return (tokens1 - tokens0) / (t1 - t0)


def peak_memory_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("tiny", *BIG_SHAPES), default="tiny")
    parser.add_argument("--num-layers", type=int, help="cut the shape's decoder layers to this many")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--warmup-steps", type=int, default=5, help="steps left out of the tokens/s")
    parser.add_argument("--accumulation", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--packing", action="store_true", help="sequences of seq-len // 4, packed into rows")
    parser.add_argument("--compare", action="store_true", help="also run transformers.Trainer + PEFT")
    parser.add_argument("--ablate", action="store_true", help="also run our loop without each speed-up")
    parser.add_argument("--no-compile", action="store_true", help="our loop with eager decoder layers")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", type=Path, help="write a torch.profiler table of three steps after the warm-up here "
                        "(the profiler slows those steps and writes its table inside the timed window: take "
                        "tokens/s from a run without it)")
    args = parser.parse_args()
    device = pick_device()
    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer, tiny = bench_base(args.shape, args.num_layers, device, Path(tmp), parser.error)
        base = LoadedBase(model=model, tokenizer=tokenizer, path=str(tiny), device=device)
        vocab = model.config.vocab_size
        rng = random.Random(0)
        examples = []
        length = args.seq_len // 4 if args.packing else args.seq_len
        per_step = args.batch * (4 if args.packing else 1)
        for _ in range(args.steps * per_step):
            ids = [rng.randrange(3, vocab) for _ in range(length)]
            examples.append(EncodedExample(input_ids=ids, labels=ids, full_length=length, truncated=False))
        hp = Hyperparameters(n_epochs=1, batch_size=per_step, learning_rate=1e-4, max_seq_length=args.seq_len,
                             r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                             gradient_accumulation_steps=args.accumulation, packing=args.packing,
                             gradient_checkpointing=args.gradient_checkpointing)  # fmt: skip

        def ours(compile_layers: bool | None, packed_attention: bool, name: str,
                 profile: Path | None = None) -> tuple[Any, StepTimer, float]:  # fmt: skip
            # The stamps steady_tokens_per_s divides by: after the warm-up, and the last step's.
            timed = (args.warmup_steps, args.steps)
            timer = ProfilingTimer(profile, args.warmup_steps, sync_steps=timed) if profile else StepTimer(timed)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            result = LoraTrainer(
                base, hp, seed=0, train=examples, valid=[], hooks=timer, work_dir=Path(tmp) / name,
                fingerprint="random", base_model_name=args.shape, checkpoint_every=10**9, log_every=10,
                compile_layers=compile_layers, packed_attention=packed_attention,
            ).run()  # fmt: skip
            return result, timer, time.perf_counter() - start

        ablations = {}
        if args.ablate:
            for label, compile_layers, packed_attention in (("eager_layers", False, True),
                                                            ("mask_attention", None, False),
                                                            ("neither", False, False)):
                _, abl_timer, _ = ours(compile_layers, packed_attention, label)
                ablations[label] = {"tokens_per_s": steady_tokens_per_s(abl_timer, args.warmup_steps),
                                    "peak_memory_gib": peak_memory_gib(device), "last_loss": abl_timer.losses[-1]}
        result, timer, total_s = ours(False if args.no_compile else None, True, "job", args.profile)
        peak_gib = peak_memory_gib(device)
        hf = run_hf_trainer(model, examples, batch=per_step, rank=args.rank, learning_rate=1e-4,
                            gradient_checkpointing=args.gradient_checkpointing,
                            warmup_steps=args.warmup_steps) if args.compare else None  # fmt: skip
    (t0, _), (t1, _) = timer.stamps[args.warmup_steps - 1], timer.stamps[-1]
    results = {
        "shape": args.shape, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "steps": result.steps, "batch": args.batch, "seq_len": args.seq_len,
        "rank": args.rank, "trained_tokens": result.trained_tokens, "total_s": total_s,
        "tokens_per_s": steady_tokens_per_s(timer, args.warmup_steps), "step_ms": (t1 - t0) / (len(timer.stamps) - args.warmup_steps) * 1e3,
        "first_loss": timer.losses[0], "last_loss": timer.losses[-1],
        "accumulation": args.accumulation, "packing": args.packing,
        "gradient_checkpointing": args.gradient_checkpointing, "peak_memory_gib": peak_gib,
        "compiled_layers": not args.no_compile and device.type == "cuda", "profiled": args.profile is not None,
    }  # fmt: skip
    for label, figures in ablations.items():
        results.update({f"{label}_tokens_per_s": figures["tokens_per_s"],
                        f"{label}_peak_memory_gib": figures["peak_memory_gib"],
                        f"{label}_last_loss": figures["last_loss"],
                        f"speedup_vs_{label}": results["tokens_per_s"] / figures["tokens_per_s"]})
    if hf is not None:
        results.update({"hf_tokens_per_s": hf["tokens_per_s"], "hf_peak_memory_gib": hf["peak_memory_gib"],
                        "speedup_vs_hf": results["tokens_per_s"] / hf["tokens_per_s"]})
    for key, value in results.items():
        print(f"{key:18s} {value:.3f}" if isinstance(value, float) else f"{key:18s} {value}")
    if args.json:
        args.json.write_text(json.dumps({**results, "card": card(device.index or 0)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
