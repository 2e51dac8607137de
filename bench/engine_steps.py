"""Timing a serving engine's steps for bench/engine.py: the decode step with every sequence of a
batch decoding, the mixed step (decodes plus one prefill chunk), and torch.profiler's tables of a
few steps."""

from __future__ import annotations

import itertools
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.profiles import write_profile
from bench.random_adapters import LLAMA3_8B
from serving.engine import LLMEngine, LoRARequest, SamplingParams


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for _ in range(batch)]


def engine_step_ms(
    engine: LLMEngine,
    prompts: list[dict[str, list[int]]],
    loras: list[LoRARequest | None],
    steps: int,
    profile_to: Path | None = None,
) -> float:
    """Median wall time of one engine step once every sequence is decoding (all in one batch).

    With ``profile_to``, three more steps run under torch.profiler: its table (ops by device and
    host time) is written there, and the device's busy time per step is returned in the file."""
    params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True, detokenize=False)
    _start_decoding(engine, prompts, loras, params, prefix="r")
    def check() -> None:
        assert engine.last_step_tokens == len(prompts), "every sequence must decode in each timed step"

    times = _time_steps(engine, steps, lambda: None, check)
    if profile_to is not None:
        _profile_steps(engine, profile_to)
    for rid in engine.request_ids():
        engine.abort_request(rid)
    return statistics.median(times[3:]) * 1e3


def _start_decoding(engine: LLMEngine, prompts: list[dict[str, list[int]]], loras: list[LoRARequest | None],
                    params: SamplingParams, *, prefix: str) -> None:
    """Adds one request per prompt and steps until every one is past its prefill (decoding)."""
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"{prefix}{i}", prompt, params, lora)
    scheduler = engine.scheduler
    while scheduler.num_waiting or any(seq.num_uncomputed_tokens != 1 for seq in scheduler.running):
        engine.step()
        if engine.last_step_tokens == 0:
            engine.wait_for_loads(0.05)


def mixed_step_ms(
    engine: LLMEngine, prompts: list[dict[str, list[int]]], loras: list[LoRARequest | None], steps: int, chunk: int,
    profile_to: Path | None = None,
) -> float:
    """Median wall time of a mixed step: all but one of ``prompts`` decoding, and a new prompt of
    ``chunk`` tokens (a one-token request, with the last of ``loras``) prefilled in the same step,
    as under Poisson arrivals most steps of a server are. ``profile_to``: as in ``engine_step_ms``."""
    params = SamplingParams(temperature=0, max_tokens=2 * steps + 64, ignore_eos=True, detokenize=False)
    _start_decoding(engine, prompts[:-1], loras[:-1], params, prefix="m")
    vocab = LLAMA3_8B["vocab_size"]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    added = itertools.count()

    def add_one() -> None:
        step = next(added)
        engine.add_request(f"new{step}", random_prompts(1, chunk, vocab, seed=100 + step)[0], one, loras[-1])

    def check() -> None:
        assert engine.last_step_tokens == len(prompts) - 1 + chunk, "each timed step decodes all and prefills one"

    times = _time_steps(engine, steps, add_one, check)
    if profile_to is not None:
        _profile_steps(engine, profile_to, before_step=add_one)
    for rid in engine.request_ids():
        engine.abort_request(rid)
    return statistics.median(times[3:]) * 1e3


def prefill_step_ms(
    engine: LLMEngine, loras: list[LoRARequest | None], steps: int, prompt_len: int, per_step: int,
    profile_to: Path | None = None, vocab: int = LLAMA3_8B["vocab_size"],
) -> float:
    """Median wall time of a step that only prefills: ``per_step`` new prompts of ``prompt_len``
    tokens (one-token requests, so each leaves in the step that prefilled it; the i-th prompt with
    ``loras[i % len(loras)]``), nothing decoding beside them and nothing from the prefix cache (every
    prompt drawn anew). ``profile_to``: as in ``engine_step_ms``."""
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    added = itertools.count()

    def add_step() -> None:
        for _ in range(per_step):
            i = next(added)
            engine.add_request(f"p{i}", random_prompts(1, prompt_len, vocab, seed=10_000 + i)[0], one,
                               loras[i % len(loras)])  # fmt: skip

    def check() -> None:
        assert engine.last_step_tokens == per_step * prompt_len, "each timed step prefills its prompts whole"
        assert not engine.has_unfinished_requests(), "each prompt's one token ends it in its own step"

    times = _time_steps(engine, steps, add_step, check)
    if profile_to is not None:
        _profile_steps(engine, profile_to, before_step=add_step)
    return statistics.median(times[3:]) * 1e3


def _time_steps(engine: LLMEngine, steps: int, before_step: Callable[[], None],
                check: Callable[[], None]) -> list[float]:  # fmt: skip
    """Wall seconds of ``steps`` + 3 steps (the median skips the first 3), each after
    ``before_step`` (not timed) and checked by ``check`` after it."""
    device = engine.runner.device
    times = []
    for _ in range(steps + 3):
        before_step()
        sync(device)
        start = time.perf_counter()
        engine.step()
        sync(device)
        times.append(time.perf_counter() - start)
        check()
    return times


def _profile_steps(engine: LLMEngine, out: Path, steps: int = 3, before_step: Callable[[], None] | None = None) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.runner.device.type == "cuda" else [])
    sync(engine.runner.device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            if before_step is not None:
                before_step()
            engine.step()
        sync(engine.runner.device)
    wall = (time.perf_counter() - start) / steps * 1e3
    device_ms = write_profile(prof, out, steps, wall)
    print(f"profile {out.name}: device busy {device_ms:.2f} ms per step")
