"""Structured output's cost on the engine's step (issue 24's targets: JSON-schema decoding adds at
most 10 % to TPOT at batch 64 on the H200 with half the batch constrained by a mix of 8 schemas,
and grammar compilation never blocks a step).

One engine (serving.engine.LLMEngine, driven step by step, each step timed with the device
synchronised), random weights (``load_format="dummy"``), no adapters, sampling at temperature 1:

1. **TPOT**: ``--batch`` sequences of ``--context``-token prompts decoding, every one free
   (``ignore_eos``), against the same batch with ``--constrained`` of them held to JSON schemas
   (bench/structured_schemas.py: 8 schemas, as many sequences each), alternated ``--repeats``
   times; the median step once every sequence decodes, over ``--steps`` steps a run. The schemas'
   documents are longer than the run, so the constrained sequences stay in the batch: the number
   alive in each timed step is reported.
2. **Step tail**: ``--tail-steps`` timed steps of the same mixed batch, three ways: steady (nothing
   arrives); ``--arrivals`` new constrained requests arriving evenly spread, their schemas
   (``arrival_schema``: a base schema renamed, with a slow-to-compile part appended) compiled
   beforehand (cached); the same arrivals with schemas never seen, compiled on the engine's grammar
   thread while the others decode. p50, p99 and max of each, and of the steps that ran while a
   compilation was in flight; each new schema's compile time (its arrival to its grammar).

Also: each schema's cold compile time on the grammar thread, and the host's mask time per
constrained row (``Guide.fill``, the part of the step a constrained row adds), over a random walk.

Shapes: ``llama3-8b`` (the Llama-3-8B config; a byte-level BPE tokenizer of 128,000 tokens plus
Llama 3's 256 special ones, trained here on generated words, as xgrammar needs a real vocabulary and
no hub is reached), bf16 on CUDA with CUDA graphs; ``tiny`` / ``small`` (serving/engine/tiny.py's
layers) with the tiny model's 512-token tokenizer, or with ``--large-vocab`` the 128k one, on the
CPU.

    python bench/structured_output.py [--shape tiny] [--large-vocab] [--batch 64] [--steps 32] [--json OUT]
    python bench/structured_output.py --shape llama3-8b [--batch 64] [--context 512] [--steps 128]
                                      [--tail-steps 400] [--json OUT]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import statistics
import sys
import tempfile
import time
import zlib
from concurrent.futures import Future
from pathlib import Path
from typing import Any

# Run as a script, this file's folder heads sys.path; the repository root must be there instead.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from bench.card import card  # noqa: E402
from bench.engine_steps import random_prompts, sync  # noqa: E402
from bench.grammar_libraries import large_tokenizer  # noqa: E402
from bench.random_adapters import LLAMA3_8B, shape_config  # noqa: E402
from bench.structured_schemas import arrival_schema, bench_schemas  # noqa: E402
from serving.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from serving.engine.guided import Guide, GuidedDecodingParams  # noqa: E402
from serving.engine.tiny import build_tiny_model  # noqa: E402

WARM_STEPS = 3  # decode steps after the prefills, before the clock: first-step costs out of the timings


def llama3_vocab_tokenizer() -> PreTrainedTokenizerFast:
    """Llama 3's vocabulary layout: 128,000 byte-level BPE tokens, then 256 special ones, of which
    ``<|begin_of_text|>`` (128000) and ``<|end_of_text|>`` (128001, the EOS) as in the config."""
    tokenizer = large_tokenizer(LLAMA3_8B["bos_token_id"])
    names = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(254)]
    tokenizer.add_special_tokens({"bos_token": names[0], "eos_token": names[1], "additional_special_tokens": names[2:]})
    ids = tokenizer.convert_tokens_to_ids(names[:2])
    if len(tokenizer) != LLAMA3_8B["vocab_size"] or ids != [LLAMA3_8B["bos_token_id"], LLAMA3_8B["eos_token_id"]]:
        raise RuntimeError(f"the generated tokenizer has {len(tokenizer)} tokens, BOS/EOS {ids}: not Llama 3's layout")
    return tokenizer


def model_dir(args: argparse.Namespace, work: Path) -> Path:
    """The shape's model directory: config and tokenizer (weights are made by the engine)."""
    if not args.large_vocab:
        return build_tiny_model(work / args.shape, size=args.shape, seed=0)
    config = dict(LLAMA3_8B)
    if args.shape != "llama3-8b":
        config.update(shape_config(args.shape))
    path = work / f"{args.shape}-128k"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    llama3_vocab_tokenizer().save_pretrained(path)
    print(f"trained the 128k tokenizer in {time.perf_counter() - start:.1f} s", flush=True)
    return path


def build_engine(args: argparse.Namespace, model: Path, floor: int) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(model), max_loras=0, device=args.device, seed=0, load_format="dummy",
        max_num_seqs=args.batch + args.arrivals, max_num_batched_tokens=max(2048, 4 * args.context),
        max_model_len=args.context + floor + 64,
    ))  # fmt: skip


def percentiles(times_ms: list[float]) -> dict[str, float]:
    """p50, p99 (nearest rank) and max of step times, and how many steps."""
    ordered = sorted(times_ms)
    if not ordered:
        return {"steps": 0}
    rank = max(0, math.ceil(0.99 * len(ordered)) - 1)
    return {"steps": len(ordered), "p50_ms": statistics.median(ordered), "p99_ms": ordered[rank], "max_ms": ordered[-1]}


class Batch:
    """The requests of one timed run: ``--batch`` sequences decoding, `constrained` of them held to
    the schemas, the rest free; started and past their prefills."""

    def __init__(self, engine: LLMEngine, args: argparse.Namespace, guides: list[GuidedDecodingParams],
                 constrained: int, max_tokens: int, tag: str) -> None:
        self.engine, self.max_tokens, self.tag = engine, max_tokens, tag
        self.vocab = engine.hf_config.vocab_size
        prompts = random_prompts(args.batch, args.context, self.vocab, seed=zlib.crc32(tag.encode()))
        # Constrained rows spread through the batch, the schemas taken in turn.
        held = {round(k * args.batch / constrained): guides[k % len(guides)] for k in range(constrained)}
        for row, prompt in enumerate(prompts):
            engine.add_request(f"{tag}-{row}", prompt, self.params(held.get(row)))
        scheduler = engine.scheduler
        while scheduler.num_waiting or any(seq.num_uncomputed_tokens != 1 for seq in scheduler.running):
            engine.step()
        for _ in range(WARM_STEPS):
            engine.step()

    def params(self, guided: GuidedDecodingParams | None) -> SamplingParams:
        if guided is None:
            return SamplingParams(temperature=1.0, max_tokens=self.max_tokens, ignore_eos=True, detokenize=False)
        return SamplingParams(temperature=1.0, max_tokens=self.max_tokens, detokenize=False, guided_decoding=guided)

    def timed_step(self) -> tuple[float, int, int, int]:
        """One engine step: its milliseconds, the tokens it computed, the sequences running before
        it (as many tokens as these: a decode-only step) and the constrained ones among them."""
        running = self.engine.scheduler.running
        decoding, alive = len(running), sum(1 for seq in running if seq.guide is not None)
        device = self.engine.runner.device
        sync(device)
        start = time.perf_counter()
        for output in self.engine.step():
            if output.error is not None:
                raise output.error
        sync(device)
        return (time.perf_counter() - start) * 1e3, self.engine.last_step_tokens, decoding, alive

    def end(self) -> None:
        for request_id in self.engine.request_ids():
            self.engine.abort_request(request_id)


def compile_all(engine: LLMEngine, guides: list[GuidedDecodingParams]) -> list[float]:
    """Each constraint compiled cold on the engine's grammar thread, one after the other: ms each."""
    times = []
    for guided in guides:
        start = time.perf_counter()
        engine.grammars.compile(guided).result()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def mask_us(engine: LLMEngine, guided: GuidedDecodingParams, tokens: int, seed: int) -> float:
    """Mean µs of one constrained row's mask (``Guide.fill``) along a walk of uniformly drawn
    allowed tokens."""
    guide = Guide(engine.grammars.compile(guided).result())
    vocab = engine.hf_config.vocab_size
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    bits = torch.arange(32, dtype=torch.int32)
    generator = torch.Generator().manual_seed(seed)
    total = 0.0
    for _ in range(tokens):
        start = time.perf_counter()
        guide.fill(bitmask, 0)
        total += time.perf_counter() - start
        allowed = ((bitmask[0].unsqueeze(1) >> bits) & 1).flatten()[:vocab].nonzero().flatten()
        if not guide.accept(int(allowed[torch.randint(len(allowed), (1,), generator=generator)])):
            raise RuntimeError("the guide refused a token its own mask allowed")
    return total / tokens * 1e6


def bench_tpot(engine: LLMEngine, args: argparse.Namespace, guides: list[GuidedDecodingParams], floor: int
               ) -> dict[str, Any]:
    runs: dict[str, dict[str, list[float]]] = {mode: {"ms": [], "alive": []} for mode in ("free", "constrained")}
    for repeat in range(args.repeats):
        for mode, run in runs.items():
            constrained = args.constrained if mode == "constrained" else 0
            batch = Batch(engine, args, guides, constrained, floor + 32, f"tpot-{mode}-{repeat}")
            for _ in range(args.steps):
                ms, decoded, _, alive = batch.timed_step()
                run["ms"].append(ms)
                run["alive"].append(alive)
                if decoded != args.batch:
                    raise RuntimeError(f"a timed step decoded {decoded} sequences, not {args.batch}")
            batch.end()
            print(f"  TPOT {mode} run {repeat + 1}: median {statistics.median(run['ms'][-args.steps:]):.2f} ms", flush=True)
    result: dict[str, Any] = {}
    for mode, run in runs.items():
        result[mode] = {"median_ms": statistics.median(run["ms"]), "mean_ms": statistics.mean(run["ms"]),
                        "steps": len(run["ms"]), "constrained_alive_min": min(run["alive"]),
                        "constrained_alive_max": max(run["alive"])}
    result["ratio"] = result["constrained"]["median_ms"] / result["free"]["median_ms"]
    return result


def _record_since(start: float, into: list[float], _: object) -> None:
    """A done callback: the ms since `start`, appended to `into`."""
    into.append((time.perf_counter() - start) * 1e3)


def bench_tail(engine: LLMEngine, args: argparse.Namespace, guides: list[GuidedDecodingParams], floor: int,
               arrivals: list[GuidedDecodingParams] | None, tag: str) -> dict[str, Any]:
    batch = Batch(engine, args, guides, args.constrained, floor + 32, tag)
    due = {round((k + 1) * args.tail_steps / (len(arrivals) + 1)): g for k, g in enumerate(arrivals)} if arrivals else {}
    prompts = random_prompts(len(due), args.context, batch.vocab, seed=zlib.crc32(f"{tag}-new".encode()))
    pending: list[Future[Any]] = []
    compile_ms: list[float] = []
    times, decode_times, compiling_times, alive_seen = [], [], [], []
    for step in range(args.tail_steps):
        if step in due:
            guided = due[step]
            added = time.perf_counter()
            engine.add_request(f"{tag}-new{step}", prompts.pop(), batch.params(guided))
            future = engine.grammars.compile(guided)  # the request's own compilation, shared by key
            future.add_done_callback(functools.partial(_record_since, added, compile_ms))
            pending.append(future)
        compiling = any(not future.done() for future in pending)
        ms, tokens, decoding, alive = batch.timed_step()
        times.append(ms)
        alive_seen.append(alive)
        if tokens == decoding:  # an arrival's prefill makes a step longer, whatever its schema
            decode_times.append(ms)
        if compiling:
            compiling_times.append(ms)
    batch.end()
    result: dict[str, Any] = {"all": percentiles(times), "decode_only": percentiles(decode_times),
                              "constrained_alive_min": min(alive_seen), "constrained_alive_max": max(alive_seen)}
    if arrivals is not None:
        result["while_compiling"] = percentiles(compiling_times)
        result["compile_ms"] = sorted(compile_ms)
    row = result["all"]
    print(f"  tail {tag}: p50 {row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f} ms, max {row['max_ms']:.2f} ms; "
          f"{len(compiling_times)} steps while compiling", flush=True)
    return result


def run(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Fills `results` part by part, saving it (``--json``) after each: a later part's failure
    keeps the earlier figures."""
    floor = max(args.steps, args.tail_steps) + WARM_STEPS + 16
    schemas = bench_schemas(floor)
    guides = [GuidedDecodingParams(json=schema) for schema in schemas]
    cached_arrivals = [GuidedDecodingParams(json=arrival_schema(schemas[k % len(schemas)], f"c{k}"))
                       for k in range(args.arrivals)]
    fresh_arrivals = [GuidedDecodingParams(json=arrival_schema(schemas[k % len(schemas)], f"n{k}"))
                      for k in range(args.arrivals)]
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(args, Path(tmp))
        start = time.perf_counter()
        engine = build_engine(args, model, floor)
        results["engine_build_s"] = time.perf_counter() - start
        print(f"engine built in {results['engine_build_s']:.1f} s", flush=True)
    start = time.perf_counter()
    engine.grammars.compile(GuidedDecodingParams(json_object=True)).result()  # the tokenizer's table, once
    results.update(grammar_setup_s=time.perf_counter() - start, floor_tokens=floor)
    results["compile_ms"] = compile_all(engine, guides)
    results["mask_us"] = [mask_us(engine, g, args.mask_walk, seed=i) for i, g in enumerate(guides)]
    for i, (ms, us) in enumerate(zip(results["compile_ms"], results["mask_us"])):
        print(f"  schema {i}: compile {ms:.1f} ms, mask {us:.1f} µs/row", flush=True)
    results["arrival_compile_ms"] = compile_all(engine, cached_arrivals)
    print(f"TPOT, batch {args.batch}, {args.constrained} constrained over {len(guides)} schemas", flush=True)
    results["tpot"] = bench_tpot(engine, args, guides, floor)
    save(args, results)
    print(f"step tail, {args.tail_steps} steps, {args.arrivals} arrivals", flush=True)
    results["tail"] = {}
    for name, arrivals in (("steady", None), ("cached_arrivals", cached_arrivals), ("new_schema_arrivals", fresh_arrivals)):
        results["tail"][name] = bench_tail(engine, args, guides, floor, arrivals, name)
        save(args, results)
    engine.shutdown()


def save(args: argparse.Namespace, results: dict[str, Any]) -> None:
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "card": card(), **results}, indent=2))


def report(args: argparse.Namespace, results: dict[str, Any]) -> None:
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    vocab = "128k" if args.large_vocab else "512"
    print(f"\n{args.shape} ({vocab} vocabulary), {args.device} ({device}), torch {torch.__version__}, batch {args.batch}, "
          f"context {args.context}, {args.constrained} constrained over 8 schemas")
    tpot = results["tpot"]
    print(f"{'TPOT':<42} {'median ms':>9} {'mean ms':>8} {'steps':>6} {'constrained alive':>18}")
    for mode in ("free", "constrained"):
        row = tpot[mode]
        print(f"{mode:<42} {row['median_ms']:>9.2f} {row['mean_ms']:>8.2f} {row['steps']:>6} "
              f"{row['constrained_alive_min']:>14}-{row['constrained_alive_max']}")
    print(f"constrained / free TPOT: {tpot['ratio']:.3f} (target <= 1.10)")
    print(f"{'step time':<42} {'p50 ms':>9} {'p99 ms':>8} {'max ms':>8} {'steps':>6} {'constrained alive':>18}")
    tail = results["tail"]
    for name, run in tail.items():
        parts = [("all steps", run["all"]), ("decode-only steps", run["decode_only"]),
                 ("steps while compiling", run.get("while_compiling", {"steps": 0}))]
        for part, row in parts:
            if row["steps"]:
                print(f"{name + ', ' + part:<42} {row['p50_ms']:>9.2f} {row['p99_ms']:>8.2f} {row['max_ms']:>8.2f} "
                      f"{row['steps']:>6} {run['constrained_alive_min']:>14}-{run['constrained_alive_max']}")
    fresh = tail["new_schema_arrivals"]
    print(f"p99 step: steady {tail['steady']['all']['p99_ms']:.2f} ms, new schemas arriving {fresh['all']['p99_ms']:.2f} ms "
          f"(cached schemas arriving {tail['cached_arrivals']['all']['p99_ms']:.2f} ms); decode-only steps: steady "
          f"{tail['steady']['decode_only']['p99_ms']:.2f} ms, new schemas arriving {fresh['decode_only']['p99_ms']:.2f} ms")
    print(f"new schemas compiled in {', '.join(f'{ms:.0f}' for ms in fresh['compile_ms'])} ms (arrival to grammar)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("tiny", "small", "llama3-8b"), default="tiny")
    parser.add_argument("--large-vocab", action="store_true", help="the 128k tokenizer (always with llama3-8b)")
    parser.add_argument("--device", default=None, help="default: cuda for llama3-8b, else cpu")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--constrained", type=int, default=None, help="default: half the batch")
    parser.add_argument("--context", type=int, default=None, help="prompt tokens (default: 512 on llama3-8b, else 64)")
    parser.add_argument("--steps", type=int, default=None, help="timed TPOT steps a run (default: 128 on llama3-8b, else 32)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tail-steps", type=int, default=None, help="default: 400 on llama3-8b, else 100")
    parser.add_argument("--arrivals", type=int, default=8)
    parser.add_argument("--mask-walk", type=int, default=64, help="tokens of each schema's mask-time walk")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    big = args.shape == "llama3-8b"
    args.large_vocab = args.large_vocab or big
    args.device = args.device or ("cuda" if big else "cpu")
    args.constrained = args.batch // 2 if args.constrained is None else args.constrained
    args.context = args.context or (512 if big else 64)
    args.steps = args.steps or (128 if big else 32)
    args.tail_steps = args.tail_steps or (400 if big else 100)
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {}
    run(args, results)
    report(args, results)


if __name__ == "__main__":
    main()
