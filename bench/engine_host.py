"""The engine's host time per decode step, the model's forward left out: how long the host's own
work (scheduling, the step's inputs, sampling's launch, reading the tokens into outputs) takes per
step and per sequence at a batch of decoding sequences over many adapters.

On the H100 the host's part of a step at ~250 sequences was ~11 ms (TPOT 29.2 ms without async
scheduling against 17.8 ms with it), as long as the GPU's step: under more load it sets the step
rate. This measures that part on the CPU, where the forward would drown it: the real engine on the
tiny model, with the runner's forward replaced by one that returns logits of the right shape at once
whose argmax is a text token (varied by position and row; here only: every other object is the
engine's own). The adapters' per-token metadata
(``LoRAMeta.prepare``, device work inside the CUDA graph on the GPU) is timed apart and left out of
the host total too.

Each batch size gets its own engine (``max_num_seqs`` = the batch, ``--adapters`` resident
rank-8 adapters, the i-th sequence on adapter ``i % adapters``), ``--prompt``-token prompts
prefilled by the real tiny model, then ``--steps`` decode steps timed, every sequence decoding in
each. Phases (us per step, then us per sequence per step):

- ``schedule``: ``Scheduler.schedule``;
- ``prepare``: ``LLMEngine._prepare`` (stamps, prefill counts, forks);
- ``layout``: ``flat_step`` (the flat step's rows and block tables on the host);
- ``inputs``: the rest of ``ModelRunner.forward`` (host tensors of the layout, the step context,
  the sampled rows' logits handed on), the layout, the LoRA metadata and the stubbed model left out;
- ``sample``: ``ModelRunner.sample`` (on the CPU the argmax itself too: tiny at this vocabulary);
- ``launched``: ``LLMEngine._launched``;
- ``process``: ``LLMEngine._process`` (tokens to the host, appended, detokenized, the outputs);
- ``other``: the rest of ``LLMEngine.step``; ``host``: the step's wall time less the LoRA metadata
  and the stubbed forward.

Then ``first``: in ``--rounds`` steps where ``--first`` new requests (16-token prompts, in place of
as many aborted ones) get their first token beside the others' decodes, the microseconds from the
step's tokens read (``_process`` entered) to its first outputs encoded for the engine-core pipe
(``OutputEncoder`` and pickling, what the child sends; the pipe and the parent's decoding left
out), median over the rounds, rounds alternating: ``at end``, the step's outputs all encoded when
``step()`` returns (no ``on_first_outputs``); ``early``, the first outputs handed on by
``on_first_outputs`` and encoded alone (what ``EngineCore`` does).

    python bench/engine_host.py [--batches 64,128,256] [--adapters 32] [--steps 40] [--sync]
                                [--profile 256] [--first 8] [--rounds 20]

``--sync``: without async scheduling (the same phases, in the other order). ``--profile B``: after
the timings, cProfile's top functions over the timed steps at batch B.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import pickle
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run as a script, this file's folder heads sys.path; the repository root must be there instead.
ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)

import torch  # noqa: E402

import serving.engine.model_runner as model_runner  # noqa: E402
from serving.engine import LLM, LLMEngine, LoRARequest, RequestOutput, SamplingParams  # noqa: E402
from serving.engine.output_deltas import OutputEncoder  # noqa: E402
from serving.engine.tiny import build_tiny_model, save_random_peft_adapter  # noqa: E402

PHASES = ("schedule", "prepare", "layout", "inputs", "sample", "launched", "process", "other", "host")
# Timed, but no part of the host's work on the GPU (inside the captured graph) or no part at all.
EXCLUDED = ("lora_meta", "forward")


class PhaseTimer:
    """Wall seconds spent in each wrapped callable, summed over the steps timed (``on``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed


def instrument(engine: LLMEngine, timer: PhaseTimer) -> None:
    """Wrap the engine's phases in ``timer`` and stub the model's forward (the flat step's: every
    timed step is a pure decode, which always runs flat)."""
    runner = engine.runner
    vocab = engine.hf_config.vocab_size
    # Text tokens, as a served model samples: zero logits would make every token id 0, a special
    # token the detokenizer skips, and the output processing would not be what serving pays.
    special = set(engine.tokenizer.all_special_ids)
    text = torch.tensor([i for i in range(vocab) if i not in special])

    def no_forward(input_ids: torch.Tensor, positions: torch.Tensor, sample_rows: torch.Tensor,
                   row_slots: list[int] | None = None) -> torch.Tensor:
        # Each sampled row's token from its position, so every sequence's text keeps changing.
        tokens = text[(positions[sample_rows] * 7919 + sample_rows) % len(text)]
        logits = torch.zeros(sample_rows.shape[0], vocab)
        logits[torch.arange(len(tokens)), tokens] = 1.0
        return logits

    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
    engine._prepare = timer.wrap("prepare", engine._prepare)  # type: ignore[method-assign]
    engine._launched = timer.wrap("launched", engine._launched)  # type: ignore[method-assign]
    engine._process = timer.wrap("process", engine._process)  # type: ignore[method-assign]
    runner.forward = timer.wrap("forward_all", runner.forward)  # type: ignore[method-assign]
    runner.sample = timer.wrap("sample", runner.sample)  # type: ignore[method-assign]
    runner._forward_sampled = timer.wrap("forward", no_forward)  # type: ignore[method-assign]
    model_runner.flat_step = timer.wrap("layout", model_runner.flat_step)  # type: ignore[assignment]
    model_runner.flat_context = timer.wrap("lora_meta", model_runner.flat_context)  # type: ignore[assignment]


def max_tokens(batch: int, prompt: int, steps: int) -> int:
    """Enough for no sequence to end in the timed steps and the profiled ones: the first ones admitted
    decode through every prefill step of the others (2048 prompt tokens a step) before the timing."""
    return 2 * steps + batch * prompt // 2048 + 32


def make_engine(model: Path, adapters: list[Path], batch: int, prompt: int, steps: int, sync: bool) -> LLMEngine:
    context = prompt + max_tokens(batch, prompt, steps) + 16
    blocks = batch * (-(-context // 16) + 1) + 64
    llm = LLM(str(model), device="cpu", max_loras=len(adapters), max_cpu_loras=len(adapters), max_lora_rank=8,
              max_num_seqs=batch, max_model_len=context, num_kv_blocks=blocks,
              async_scheduling=not sync)  # fmt: skip
    return llm.llm_engine


def start_decoding(engine: LLMEngine, adapters: list[Path], batch: int, prompt: int, steps: int) -> None:
    """``batch`` requests of distinct ``prompt``-token prompts, the i-th on adapter ``i % len(adapters)``,
    stepped (the real model) until every one is decoding."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens(batch, prompt, steps), ignore_eos=True)
    loras = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(adapters)]
    vocab = engine.hf_config.vocab_size
    for i in range(batch):
        ids = [3 + (i * 7919 + t * 104729) % (vocab - 3) for t in range(prompt)]
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params, loras[i % len(loras)])
    scheduler = engine.scheduler
    while scheduler.num_waiting or any(seq.num_uncomputed_tokens > 1 for seq in scheduler.running):
        engine.step()
        if engine.last_step_tokens == 0:
            engine.wait_for_loads(0.05)


def time_first_outputs(engine: LLMEngine, adapters: list[Path], first: int, rounds: int) -> tuple[float, float]:
    """Median microseconds from a step's tokens read to its ``first`` first outputs encoded for the
    pipe: ``(at end, early)`` (the module's docstring)."""
    encoder = OutputEncoder()
    read: list[float] = []
    process = engine._process

    def entered(*args: Any) -> list[RequestOutput]:
        read.append(time.perf_counter())
        return process(*args)

    engine._process = entered  # type: ignore[method-assign]
    encoded: list[float] = []

    def send(outputs: list[RequestOutput]) -> None:
        pickle.dumps(encoder.encode(outputs))
        encoded.append(time.perf_counter())

    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    loras = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(adapters)]
    vocab = engine.hf_config.vocab_size
    names = itertools.count()
    send(engine.step())  # every request under way goes whole once, as it would have at its first token
    timings: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(rounds):
        early = bool(round_ % 2)
        for request_id in engine.request_ids()[:first]:
            engine.abort_request(request_id)
            encoder.forget(request_id)
        added = set()
        for _ in range(first):
            i = next(names)
            added.add(f"new{i}")
            ids = [3 + (i * 31 + t) % (vocab - 3) for t in range(16)]
            engine.add_request(f"new{i}", {"prompt_token_ids": ids}, params, loras[i % len(loras)])
        while added:
            read.clear()
            encoded.clear()
            outputs = engine.step(send if early else None)
            firsts = [out for out in outputs if out.request_id in added]
            send(outputs)
            if early and encoded[:-1]:
                assert not firsts, "a first output handed on early is not returned"
                timings[True].append(encoded[0] - read[0])
                added.clear()
            elif firsts:
                assert len(firsts) == first, "the new requests' first tokens in one step"
                timings[False].append(encoded[-1] - read[0])
                added.clear()
    engine._process = process  # type: ignore[method-assign]
    return 1e6 * statistics.median(timings[False]), 1e6 * statistics.median(timings[True])


def time_batch(model: Path, adapters: list[Path], batch: int, prompt: int, steps: int, sync: bool,
               profile: bool, first: int, rounds: int) -> dict[str, float]:  # fmt: skip
    """Microseconds per step of each phase over ``steps`` decode steps of ``batch`` sequences, and
    the ``first`` timings (``time_first_outputs``)."""
    engine = make_engine(model, adapters, batch, prompt, steps, sync)
    start_decoding(engine, adapters, batch, prompt, steps)
    timer = PhaseTimer()
    instrument(engine, timer)
    for _ in range(3):  # the stub's first steps, and async scheduling's first step in flight
        engine.step()
    walls = []
    timer.on = True
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
        assert engine.last_step_tokens == batch, f"a step decoded {engine.last_step_tokens} of {batch} sequences"
    timer.on = False
    if profile:  # more steps, apart from the timed ones (cProfile slows every call it sees)
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [engine.step() for _ in range(steps)])
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
        print(f"\ncProfile, batch {batch}, {steps} steps (tottime: the function's own time):")
        print(out.getvalue())
    first_at_end, first_early = time_first_outputs(engine, adapters, first, rounds)
    engine.shutdown()
    s = timer.seconds
    us = {name: 1e6 * seconds / steps for name, seconds in s.items()}
    wall = 1e6 * sum(walls) / steps
    us["inputs"] = us["forward_all"] - us["layout"] - us["lora_meta"] - us["forward"]
    us["host"] = wall - us["lora_meta"] - us["forward"]
    us["other"] = us["host"] - sum(us[name] for name in PHASES[:-2])
    us["median_host"] = 1e6 * statistics.median(walls) - us["lora_meta"] - us["forward"]
    us["first_at_end"], us["first_early"] = first_at_end, first_early
    return us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="64,128,256")
    parser.add_argument("--adapters", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sync", action="store_true", help="without async scheduling")
    parser.add_argument("--profile", type=int, default=None, metavar="B", help="cProfile the steps at batch B")
    parser.add_argument("--first", type=int, default=8, help="new requests a round of the first-output timing")
    parser.add_argument("--rounds", type=int, default=20, help="rounds of the first-output timing")
    args = parser.parse_args()
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(f"engine host time per decode step, forward stubbed: {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, commit {commit}, {'sync' if args.sync else 'async'} scheduling, "
          f"{args.adapters} adapters, {args.prompt}-token prompts, {args.steps} steps")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model")
        adapters = [save_random_peft_adapter(model, Path(tmp) / f"a{i}", r=8, lora_alpha=16,
                                             target_modules=("q_proj", "v_proj"), seed=i)
                    for i in range(args.adapters)]  # fmt: skip
        results = {b: time_batch(model, adapters, b, args.prompt, args.steps, args.sync, args.profile == b,
                                 args.first, args.rounds)
                   for b in batches}  # fmt: skip
    header = f"{'phase':<10}" + "".join(f"{f'B={b} us/step':>16}{'us/seq':>9}" for b in batches)
    print(header)
    for name in (*PHASES, "median_host", *EXCLUDED):
        label = f"({name})" if name in EXCLUDED else name
        print(f"{label:<10}" + "".join(f"{results[b][name]:>16.0f}{results[b][name] / b:>9.2f}" for b in batches))
    print(f"\n{args.first} first outputs, tokens read -> encoded for the pipe (us, median of {args.rounds // 2} steps):")
    for name, label in (("first_at_end", "at end"), ("first_early", "early")):
        print(f"{label:<10}" + "".join(f"{results[b][name]:>16.0f}{'':>9}" for b in batches))


if __name__ == "__main__":
    main()
