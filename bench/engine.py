"""Serving-engine benchmark: decode-step time with many distinct adapters against base-only, PEFT's
mixed batch and transformers' own forward, and output tokens/s against transformers' generate.

CPU (default): the ``small`` tiny model (hidden 512, 8 layers) built on the spot, fp32, with
PEFT-saved rank-16 adapters on all seven projections. In one run it times:

- ``engine base``: one engine step decoding ``--batch`` sequences, no adapter;
- ``engine N adapters``: the same with the batch spread over N distinct adapters;
- ``PEFT mixed``: PEFT's forward of the same one-token-per-sequence batch with ``adapter_names=``
  (a KV cache of the same length), and ``transformers base`` the plain model's forward;
- end to end: ``LLM.generate`` output tokens/s (base and N adapters) against ``generate`` of
  transformers (base) and of PEFT with ``adapter_names=``, same prompts, greedy, same lengths.

CUDA (``--shape llama3-8b``): the Llama-3-8B shape with random weights made on the device
(``load_format="dummy"``, nothing written but the config), bf16, batch 64, context 512, 32
distinct rank-16 adapters (written in PEFT's format to a RAM disk and loaded through the engine's
own loader) against base-only, for each of ``--modes`` in one engine (``graph``: CUDA-graph
replay; ``eager``: eager with the paged-attention kernel; ``eager-torch``: eager with the page
gather + SDPA, the engine before both levers), the mixed step (``--mixed-chunk``: batch - 1
sequences decoding while one new prompt is prefilled), the slot write of one adapter (CPU cache →
GPU slot), GPU memory by holder, and optionally transformers' base forward and PEFT's mixed batch (8 and ``--adapters``
adapters, one token per sequence, no KV cache: targets.md's reference measurement).

    python bench/engine.py [--batch 32] [--adapters 8] [--threads 1] [--json OUT]
    python bench/engine.py --shape llama3-8b [--batch 64] [--context 512] [--adapters 32] [--json OUT]
                           [--modes graph,eager,eager-torch] [--profile-dir DIR] [--compare-transformers]
                           [--compare-peft] [--mixed-chunk 256] [--prefill-tokens 2048]

``--prefill-tokens`` (default 2048, the worker's default token budget) also times, for each mode, a
step that only prefills (prompts of ``--context`` tokens, nothing decoding, nothing cached), base and
with a different adapter per prompt, and prints it as prompt tok/s and as a share of the bf16 GEMM
roof measured at start (``bench/card.py``, ``gemm_tflops``): issue 38's item 1.

Tensor parallelism (issue 28): ``--tensor-parallel-size 2`` runs every engine of the run sharded
over two processes (gloo on CPU, NCCL on CUDA; CUDA graphs are not captured then, so ``--modes
eager`` or ``eager-torch``); memory figures are rank 0's. The 8B decode-step table at TP 1 and 2:

    python bench/engine.py --shape llama3-8b --modes eager [--tensor-parallel-size 2] [--json OUT]

The decode-step table (issue 21): ``--adapter-sweep 32,64,128,256`` times, for each count N, the
step of batch max(--batch, N) with N distinct adapters against the base step at that batch, in one
engine sized for the largest (``max_loras`` = the largest count), instead of the run above:

    python bench/engine.py --shape llama3-8b --adapter-sweep 32,64,128,256 --modes graph [--json OUT]

FP8 base weights (issue 22, item 3): ``--quantization fp8`` times, in the same run, a second engine
whose base projections are FP8 (``EngineConfig.quantization``) beside the bf16 one, every figure of
it under an ``fp8_`` prefix, and prints each mode's base, LoRA and mixed steps side by side with the
ratio (target: base step <= 0.6 x bf16's). The engines run one after the other (each sizes its KV
cache from what the GPU has free). On the CPU the FP8 layers are an emulation (slower than fp32:
its figures say nothing of the GPU's). With ``--adapter-sweep`` the sweep's one engine is FP8.

    python bench/engine.py --shape llama3-8b --modes graph --quantization fp8 [--json OUT]

With ``--profile-dir DIR`` each timed step kind (each batch's base step, each count's LoRA step)
is also run under torch.profiler, the tables of a mode in one file, ``DIR/profile_sweep_MODE.txt``
(``--modes graph,eager``: eager shows every kernel, graph what a replay shows).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this file's folder heads sys.path; the repository root must be there instead.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402

from serving.engine import LLM, EngineConfig, LLMEngine, LoRARequest, SamplingParams  # noqa: E402
from serving.engine.model_runner import ModelRunner  # noqa: E402
from serving.engine.tiny import build_tiny_model, save_random_peft_adapter  # noqa: E402

from bench.card import bandwidth_figures, card  # noqa: E402
from bench.engine_peers import hf_decode_step_ms, peft_forward_ms, transformers_forward_ms  # noqa: E402
from bench.engine_steps import engine_step_ms, mixed_step_ms, prefill_step_ms, random_prompts  # noqa: E402
from bench.random_adapters import (  # noqa: E402
    LLAMA3_8B, MODULE_SETS, adapter_bytes, adapter_set, temporary_root,
)

MODULES = MODULE_SETS["all"]


def _engine(model_dir: Path, args: argparse.Namespace, **overrides: object) -> LLMEngine:
    config = dict(
        model=str(model_dir),
        max_loras=max(args.adapters, 1),
        max_cpu_loras=max(args.adapters, 1),
        max_lora_rank=args.rank,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(2048, args.batch * 8),
        max_model_len=args.context + args.steps + 128,
        device=args.device,
        seed=0,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


# ---- CPU: the small tiny model, against PEFT and transformers -------------------------------


def bench_cpu(args: argparse.Namespace, work: Path) -> dict[str, float]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = build_tiny_model(work / "small", arch="llama", size="small", seed=0)
    adapters = [
        save_random_peft_adapter(base, work / f"adapter{i}", r=args.rank, lora_alpha=2 * args.rank, target_modules=MODULES, seed=i)
        for i in range(args.adapters)
    ]
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(args.batch, args.context, vocab, seed=1)
    names = [f"a{i}" for i in range(args.adapters)]
    spread = [LoRARequest(names[i % args.adapters], str(adapters[i % args.adapters])) for i in range(args.batch)]
    results: dict[str, float] = {}

    for quantization in args.quantizations:
        engine = _engine(base, args, quantization=quantization)
        prefix = f"{quantization}_" if quantization else ""
        results[f"{prefix}engine_base_step_ms"] = engine_step_ms(engine, prompts, [None] * args.batch, args.steps)
        results[f"{prefix}engine_lora_step_ms"] = engine_step_ms(engine, prompts, spread, args.steps)
        engine.shutdown()

    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(hf, str(adapters[0]), adapter_name=names[0])
    for name, path in zip(names[1:], adapters[1:]):
        peft.load_adapter(str(path), adapter_name=name)
    peft.eval()
    ids = torch.tensor([p["prompt_token_ids"] for p in prompts])
    row_names = [names[i % args.adapters] for i in range(args.batch)]
    results["peft_mixed_step_ms"] = hf_decode_step_ms(peft, ids, args.steps, adapter_names=row_names)
    with peft.disable_adapter():
        results["transformers_base_step_ms"] = hf_decode_step_ms(peft, ids, args.steps)

    new = args.new_tokens
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm = LLM(str(base), max_loras=args.adapters, max_lora_rank=args.rank, max_num_seqs=args.batch, device=args.device,
              tensor_parallel_size=args.tensor_parallel_size)  # fmt: skip
    for key, loras in (("engine_base_tok_s", None), ("engine_lora_tok_s", spread)):
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2), lora_request=loras[:2] if loras else None)
        start = time.perf_counter()
        llm.generate(prompts, params, lora_request=loras)
        results[key] = args.batch * new / (time.perf_counter() - start)
    with torch.no_grad():
        for key, kwargs in (("transformers_generate_tok_s", {}), ("peft_generate_tok_s", {"adapter_names": row_names})):
            start = time.perf_counter()
            if kwargs:
                out = peft.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)
            else:
                with peft.disable_adapter():
                    out = peft.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            assert out.shape[1] == ids.shape[1] + new
            results[key] = args.batch * new / (time.perf_counter() - start)
    return results


# ---- CUDA: the Llama-3-8B shape ----------------------------------------------------------------


def _llama3_8b_dir(work: Path) -> Path:
    """The Llama-3-8B shape's model directory: its config and a tokenizer, no weights (the engine
    makes random ones on the device, ``load_format="dummy"``)."""
    model_dir = work / "llama3-8b-shape"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA3_8B))
    # Any tokenizer will do: prompts are token ids and outputs are not detokenized.
    tiny = build_tiny_model(work / "tiny", arch="llama", size="tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny / name).exists():
            shutil.copy(tiny / name, model_dir / name)
    return model_dir


def _preload(engine: LLMEngine, names: list[LoRARequest]) -> float:
    """Reads every adapter into the CPU cache; the seconds it took. Done before timing: sequences
    admitted early would otherwise decode to their max_tokens while the last adapters load, and
    leave the batch before the timed steps."""
    start = time.perf_counter()
    futures = [engine.add_lora(request) for request in names]
    while not all(future.done() for future in futures):  # loads complete in the engine's step
        engine.wait_for_loads(0.05)
        engine.step()
    for future in futures:
        future.result()
    return time.perf_counter() - start


def bench_llama3_8b(args: argparse.Namespace, work: Path) -> dict[str, float]:
    model_dir = _llama3_8b_dir(work)
    start = time.perf_counter()
    adapters, _ = adapter_set(work, "llama3-8b", count=args.adapters, rank=args.rank, modules="all")
    results = {"adapters_write_s": time.perf_counter() - start}
    for quantization in args.quantizations:
        prefix = f"{quantization}_" if quantization else ""
        figures = _bench_llama3_8b_engine(args, model_dir, adapters, quantization)
        results.update({prefix + key: value for key, value in figures.items()})
    # The engine's figures before the peers' (slow to build): a run cut short still reports them.
    print(f"engine results: {json.dumps(results)}", flush=True)
    if args.quantization:
        _print_quantized(args, results)
    if args.compare_transformers:
        results["transformers_base_forward_ms"] = transformers_forward_ms(model_dir, args)
    if args.compare_peft:
        results.update(peft_forward_ms(model_dir, adapters, args))
    return results


def _bench_llama3_8b_engine(args: argparse.Namespace, model_dir: Path, adapters: list[Path],
                            quantization: str | None) -> dict[str, float]:  # fmt: skip
    """One engine's figures (its base weights bf16, or ``quantization``); the engine is shut down
    and its memory handed back before this returns."""
    results: dict[str, float] = {}
    tag = f"{quantization}_" if quantization else ""  # of its profile files
    start = time.perf_counter()
    engine = _engine(
        model_dir, args, load_format="dummy", max_num_batched_tokens=8192, block_size=16,
        enforce_eager="graph" not in args.modes, quantization=quantization,
        **({"max_flat_tokens": args.max_flat_tokens} if args.max_flat_tokens else {}),
    )  # fmt: skip
    results["engine_build_s"] = time.perf_counter() - start
    results.update(_memory_gib(engine, args.rank))
    prompts = random_prompts(args.batch, args.context, LLAMA3_8B["vocab_size"], seed=1)
    names = [LoRARequest(f"a{i}", str(path)) for i, path in enumerate(adapters)]
    spread = [names[i % args.adapters] for i in range(args.batch)]
    results["adapters_load_s"] = _preload(engine, names)
    runner = engine.runner
    if runner.graphs is not None:
        results["graph_capture_s"] = runner.graphs.capture_seconds
        results["graph_memory_mib"] = runner.graphs.memory_bytes / 2**20
    results["memory_allocated_gib"] = torch.cuda.memory_allocated() / 2**30
    for mode in args.modes:
        runner.enforce_eager = mode != "graph"
        runner.attention = "torch" if mode == "eager-torch" else "triton"
        # The eager step's profile shows every kernel (a replayed graph's do not all appear).
        profiled = "eager" if "eager" in args.modes else args.modes[0]
        profile = args.profile_dir if mode == profiled else None
        results[f"{mode}_base_step_ms"] = engine_step_ms(
            engine, prompts, [None] * args.batch, args.steps, profile / f"profile_{tag}{mode}_base.txt" if profile else None
        )
        start = time.perf_counter()
        results[f"{mode}_lora_step_ms"] = engine_step_ms(
            engine, prompts, spread, args.steps, profile / f"profile_{tag}{mode}_lora.txt" if profile else None
        )
        results[f"{mode}_lora_over_base"] = results[f"{mode}_lora_step_ms"] / results[f"{mode}_base_step_ms"]
        if args.mixed_chunk:
            results[f"{mode}_mixed_lora_step_ms"] = mixed_step_ms(
                engine, prompts, spread, args.steps, args.mixed_chunk, profile / f"profile_{tag}{mode}_mixed.txt" if profile else None
            )
        if args.prefill_tokens:
            results.update(_prefill_figures(engine, args, mode, spread, profile, tag))
        print(f"{quantization or 'bf16'} {mode}: base {results[f'{mode}_base_step_ms']:.2f} ms, {args.adapters} adapters "
              f"{results[f'{mode}_lora_step_ms']:.2f} ms, mixed {results.get(f'{mode}_mixed_lora_step_ms', 0):.2f} ms",
              flush=True)  # fmt: skip
        if "lora_run_total_s" not in results:
            results["lora_run_total_s"] = time.perf_counter() - start
    headline = "graph" if "graph" in args.modes else args.modes[0]
    results["engine_base_step_ms"] = results[f"{headline}_base_step_ms"]
    results["engine_lora_step_ms"] = results[f"{headline}_lora_step_ms"]
    results["memory_with_adapters_gib"] = torch.cuda.memory_allocated() / 2**30
    stats = engine.stats()
    results["adapter_load_mean_s"] = stats.adapter_load_seconds_total / max(stats.adapter_loads, 1)
    results["slot_write_ms"] = _slot_write_ms(engine)
    # Weights + lm_head (targets.md) plus one read of every layer's K and V for batch x context,
    # at this card's bandwidth (bench/card.py): measured, and the datasheet's where the card is known.
    weights = _weight_bytes(runner)
    results["floor_ms"] = decode_floor_ms(weights, args.batch, args.context, args.bandwidth["copy_bandwidth_tb_s"] * 1e12)
    if "spec_bandwidth_tb_s" in args.bandwidth:
        results["spec_floor_ms"] = decode_floor_ms(weights, args.batch, args.context,
                                                   args.bandwidth["spec_bandwidth_tb_s"] * 1e12)
    print(f"floor {results['floor_ms']:.2f} ms at the measured {args.bandwidth['copy_bandwidth_tb_s']:.2f} TB/s"
          + (f", {results['spec_floor_ms']:.2f} ms at the datasheet's {args.bandwidth['spec_bandwidth_tb_s']:.2f} TB/s"
             if "spec_floor_ms" in results else ""), flush=True)
    engine.shutdown()
    del engine, runner
    torch.cuda.empty_cache()
    return results


def _prefill_figures(engine: LLMEngine, args: argparse.Namespace, mode: str, spread: list[LoRARequest],
                     profile: Path | None, tag: str) -> dict[str, float]:  # fmt: skip
    """A prefill-only step of ``--prefill-tokens`` (prompts of ``--context`` tokens), base and with
    adapters (a different one per prompt), as prompt tok/s and as a share of the card's measured
    GEMM roof (issue 38, item 1: base >= 65 %, adapters <= 1.1 x base)."""
    per_step = max(1, args.prefill_tokens // args.context)
    tokens = per_step * args.context
    figures: dict[str, float] = {}
    for kind, loras in (("base", [None]), ("lora", list(spread))):
        ms = prefill_step_ms(engine, loras, args.steps, args.context, per_step,
                             profile / f"profile_{tag}{mode}_prefill_{kind}.txt" if profile else None)  # fmt: skip
        figures[f"{mode}_prefill_{kind}_step_ms"] = ms
        figures[f"{mode}_prefill_{kind}_tok_s"] = tokens / ms * 1e3
    # The work of a prompt token: two FLOPs a weight of every projection (the LM head runs for the
    # last token only) and causal attention's QK^T and PV over half the prompt on average.
    layers, hidden = LLAMA3_8B["num_hidden_layers"], LLAMA3_8B["hidden_size"]
    weights = sum(layer.weight.numel() for layer in engine.runner.model.lora_layers())
    flops_per_token = 2 * weights + 2 * layers * hidden * args.context
    roof = args.bandwidth.get("gemm_tflops")
    for kind in ("base", "lora"):
        tflops = figures[f"{mode}_prefill_{kind}_tok_s"] * flops_per_token / 1e12
        figures[f"{mode}_prefill_{kind}_tflops"] = tflops
        if roof:
            figures[f"{mode}_prefill_{kind}_of_roof"] = tflops / roof
    figures[f"{mode}_prefill_lora_over_base"] = figures[f"{mode}_prefill_lora_step_ms"] / figures[f"{mode}_prefill_base_step_ms"]
    print(f"{mode} prefill step of {tokens} tokens ({per_step} x {args.context}): base "
          f"{figures[f'{mode}_prefill_base_step_ms']:.2f} ms = {figures[f'{mode}_prefill_base_tok_s']:,.0f} tok/s "
          f"({figures[f'{mode}_prefill_base_tflops']:.0f} TFLOP/s"
          + (f", {figures[f'{mode}_prefill_base_of_roof']:.0%} of the measured {roof:.0f}" if roof else "")
          + f"); {args.adapters} adapters {figures[f'{mode}_prefill_lora_step_ms']:.2f} ms "
          f"({figures[f'{mode}_prefill_lora_over_base']:.2f} x base)", flush=True)
    return figures


def decode_floor_ms(weight_bytes: int, batch: int, context: int, bandwidth: float) -> float:
    """The 8B shape's decode step floor: ``weight_bytes`` and one read of every layer's bf16 K and V
    for ``batch`` sequences of ``context`` tokens, at ``bandwidth`` bytes/s."""
    kv_bytes = 2 * LLAMA3_8B["num_hidden_layers"] * LLAMA3_8B["num_key_value_heads"] * 128 * 2 * batch * context
    return (weight_bytes + kv_bytes) / bandwidth * 1e3


def _weight_bytes(runner: ModelRunner) -> int:
    """Bytes a decode step reads of the 8B shape's weights: every projection as this engine holds
    it (FP8: one byte a weight) and the bf16 LM head (15.0 GB in bf16: targets.md's 3.13 ms at 4.8 TB/s)."""
    held = sum(layer.weight.numel() * layer.weight.element_size() for layer in runner.model.lora_layers())
    return held + LLAMA3_8B["vocab_size"] * LLAMA3_8B["hidden_size"] * 2


def _print_quantized(args: argparse.Namespace, results: dict[str, float]) -> None:
    """Each mode's steps, bf16 beside ``--quantization``'s, and their ratio (into ``results`` too)."""
    q = args.quantization
    print(f"\n| mode | step | bf16 (ms) | {q} (ms) | {q} / bf16 |")
    print("| --- | --- | ---: | ---: | ---: |")
    for mode in args.modes:
        for step, key in (("base", "base_step_ms"), (f"{args.adapters} adapters", "lora_step_ms"),
                          (f"mixed (chunk {args.mixed_chunk})", "mixed_lora_step_ms")):  # fmt: skip
            if f"{mode}_{key}" not in results:
                continue
            plain, quantized = results[f"{mode}_{key}"], results[f"{q}_{mode}_{key}"]
            results[f"{q}_over_bf16_{mode}_{key}"] = quantized / plain
            print(f"| {mode} | {step} | {plain:.2f} | {quantized:.2f} | {quantized / plain:.2f} |")
    print(f"| | floor | {results['floor_ms']:.2f} | {results[f'{q}_floor_ms']:.2f} | "
          f"{results[f'{q}_floor_ms'] / results['floor_ms']:.2f} |")  # fmt: skip
    print(f"(issue 22's target: the {q} base step <= 0.6 x bf16's)\n", flush=True)


# ---- the decode-step table: many distinct adapters in one batch (issue 21) ----------------------

# Issue 21's bound for the decode step with 64, 128 and 256 distinct adapters in the batch.
SWEEP_TARGET = 1.3


def bench_sweep(args: argparse.Namespace, work: Path) -> dict[str, float]:
    """For each count N of ``--adapter-sweep``: one decode step of batch max(--batch, N), every
    sequence's adapter the (i mod N)-th, against the base step at the same batch (a batch of 64
    cannot hold 128 distinct adapters). One engine sized for the largest batch and count, with
    ``max_loras`` given as that count (the engine may size adapter memory by bytes otherwise), every
    adapter in the CPU cache before the first timed step."""
    big = args.shape == "llama3-8b"
    counts = args.adapter_sweep
    batches = {n: max(args.batch, n) for n in counts}
    if big:
        model_dir = _llama3_8b_dir(work)
        overrides: dict[str, object] = dict(load_format="dummy", max_num_batched_tokens=8192, block_size=16,
                                            enforce_eager="graph" not in args.modes)
    else:
        model_dir, overrides = build_tiny_model(work / "small", arch="llama", size="small", seed=0), {}
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    start = time.perf_counter()
    adapters, _ = adapter_set(work, args.shape, count=max(counts), rank=args.rank, modules="all")
    results: dict[str, float] = {"adapters_write_s": time.perf_counter() - start}
    engine = _engine(model_dir, args, max_loras=max(counts), max_cpu_loras=max(counts),
                     max_num_seqs=max(batches.values()), quantization=args.quantization, **overrides)
    names = [LoRARequest(f"a{i}", str(path)) for i, path in enumerate(adapters)]
    results["adapters_load_s"] = _preload(engine, names)
    runner = engine.runner
    rows = []
    # One profile file per mode (the device tool brings back few files): each step kind's table, in turn.
    profiles = work / "sweep_profiles" if args.profile_dir else None
    if profiles:
        profiles.mkdir()
    for mode in args.modes if big else ["cpu"]:
        if big:
            runner.enforce_eager = mode != "graph"
            runner.attention = "torch" if mode == "eager-torch" else "triton"
        base_ms: dict[int, float] = {}
        for n in counts:
            batch = batches[n]
            prompts = random_prompts(batch, args.context, vocab, seed=1)
            if batch not in base_ms:
                base_ms[batch] = engine_step_ms(engine, prompts, [None] * batch, args.steps,
                                                profiles / f"{mode}_base_batch{batch}.txt" if profiles else None)
            lora_ms = engine_step_ms(engine, prompts, [names[i % n] for i in range(batch)], args.steps,
                                     profiles / f"{mode}_lora_{n}.txt" if profiles else None)
            key = f"sweep_{mode}_{n}"
            results.update({f"{key}_batch": batch, f"{key}_base_step_ms": base_ms[batch], f"{key}_lora_step_ms": lora_ms,
                            f"{key}_over_base": lora_ms / base_ms[batch]})  # fmt: skip
            rows.append((mode, n, batch, base_ms[batch], lora_ms))
            print(f"{mode}: {n} distinct adapters, batch {batch}: base {base_ms[batch]:.2f} ms, LoRA {lora_ms:.2f} ms",
                  flush=True)
    engine.shutdown()
    if profiles:
        for mode in {mode for mode, *_ in rows}:
            parts = sorted(profiles.glob(f"{mode}_*.txt"))
            (args.profile_dir / f"profile_sweep_{mode}.txt").write_text(
                "".join(f"=== {part.stem}\n{part.read_text()}\n\n" for part in parts))
    print(f"\n| mode | distinct adapters | batch | base step (ms) | LoRA step (ms) | LoRA / base (target <= {SWEEP_TARGET}) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for mode, n, batch, base_step, lora_step in rows:
        ratio = lora_step / base_step
        print(f"| {mode} | {n} | {batch} | {base_step:.2f} | {lora_step:.2f} | {ratio:.2f} "
              f"({'met' if ratio <= SWEEP_TARGET else 'not met'}) |")
    print("(batch = max(--batch, adapters): every sequence has an adapter, each adapter at least one sequence)\n")
    return results


def _memory_gib(engine: LLMEngine, rank: int) -> dict[str, float]:
    """GPU memory by what holds it, before any adapter is loaded: the base weights, the adapter
    memory (sized by the engine: slots or a pool of rank rows), the KV cache, the captured graphs,
    and all of it; and how many rank-``rank`` adapters on all projections the adapter memory holds
    (its bytes over one adapter's own, not ``max_loras``: the engine may size it by bytes)."""
    runner = engine.runner
    pools = {id(t): t for layer in runner.model.lora_layers() for t in (*layer.lora_A, *layer.lora_B)}
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    # FP8 projections' per-channel scales (fp32) sit beside their weights, not among the parameters.
    weights += sum(layer.weight_scale.numel() * 4 for layer in runner.model.lora_layers() if layer.weight_scale is not None)
    lora_bytes = sum(t.numel() * t.element_size() for t in pools.values())
    one = adapter_bytes(LLAMA3_8B, rank, MODULES, runner.dtype.itemsize)
    return {
        "memory_weights_gib": weights / 2**30,
        "memory_lora_gib": lora_bytes / 2**30,
        "memory_lora_holds_adapters": lora_bytes // one,
        "memory_kv_cache_gib": runner.kv_cache.numel() * runner.kv_cache.element_size() / 2**30,
        "memory_graphs_gib": (runner.graphs.memory_bytes if runner.graphs else 0) / 2**30,
        "memory_before_adapters_gib": torch.cuda.memory_allocated() / 2**30,
    }


def _slot_write_ms(engine: LLMEngine) -> float:
    """Median time to copy one CPU-cached adapter into its GPU rows (``write_rows``, synchronised):
    a resident adapter's own content again, into its own rows, so the cache's bookkeeping stays true."""
    cache = engine.lora_cache
    assert cache is not None
    adapter = next(a for a in cache.slots() if a is not None)
    assert adapter.weights is not None and adapter.slot is not None and adapter.row is not None
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.runner.write_rows(adapter.slot, adapter.row, adapter)
        torch.cuda.synchronize()  # the copy runs on the copy stream: this waits for it too
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("small", "llama3-8b"), default="small")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--adapters", type=int)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--context", type=int, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per prompt in the tok/s runs")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the dev machine's 2 cores are shared)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="shard each engine over this many processes")
    parser.add_argument(
        "--quantization", choices=("fp8",), default=None,
        help="also time an engine with FP8 base weights, beside the bf16 one (with --adapter-sweep: instead)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--profile-dir", type=Path, help="llama3-8b: write torch.profiler tables of a few steps here")
    parser.add_argument("--compare-transformers", action="store_true", help="llama3-8b: also time transformers' forward")
    parser.add_argument("--compare-peft", action="store_true", help="llama3-8b: also time PEFT's mixed batch")
    parser.add_argument(
        "--mixed-chunk", type=int, default=256,
        help="llama3-8b: also time mixed steps, batch - 1 decoding and one prompt of this many tokens (0: off)",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-tokens", type=int, default=2048,
        help="llama3-8b: also time prefill-only steps of this many prompt tokens, prompts of --context tokens (0: off)",
    )  # fmt: skip
    parser.add_argument(
        "--max-flat-tokens", type=int, default=0,
        help="llama3-8b: the engine's max_flat_tokens (0: its default); a step over it attends its prompt chunks "
        "with SDPA instead of the paged kernel, and runs eagerly",
    )  # fmt: skip
    parser.add_argument(
        "--modes", default="graph,eager,eager-torch", help="llama3-8b: comma-separated graph, eager, eager-torch"
    )
    parser.add_argument(
        "--adapter-sweep", default="",
        help="comma-separated counts of distinct adapters (e.g. 32,64,128,256): the decode-step table, batch "
        "max(--batch, count), against the base step; replaces the --adapters run (no mixed step, no peers)",
    )  # fmt: skip
    args = parser.parse_args()
    args.modes = args.modes.split(",")
    if not set(args.modes) <= {"graph", "eager", "eager-torch"}:
        parser.error(f"--modes takes graph, eager and eager-torch, got {args.modes}")
    if args.tensor_parallel_size > 1 and args.shape != "small" and "graph" in args.modes:
        parser.error("--modes graph needs --tensor-parallel-size 1: CUDA graphs are not captured at TP > 1")
    try:
        args.adapter_sweep = [int(n) for n in args.adapter_sweep.split(",")] if args.adapter_sweep else []
    except ValueError:
        parser.error(f"--adapter-sweep takes comma-separated counts, got {args.adapter_sweep!r}")
    if any(n < 1 for n in args.adapter_sweep):
        parser.error(f"--adapter-sweep counts must be >= 1, got {args.adapter_sweep}")
    big = args.shape == "llama3-8b"
    # The engines timed: the model's dtype's, then --quantization's.
    args.quantizations = [None, args.quantization] if args.quantization else [None]
    args.batch = args.batch or (64 if big else 32)
    args.adapters = args.adapters or (32 if big else 8)
    args.context = args.context or (512 if big else 64)
    args.device = args.device or ("cuda" if big else "cpu")
    torch.set_num_threads(args.threads)
    # Before any engine takes the memory: the copy buffers (2 GiB) are handed back after.
    args.bandwidth = bandwidth_figures(torch.device(args.device)) if big else {}
    count = max(args.adapter_sweep) if args.adapter_sweep else args.adapters
    # The 8B shape's adapters on /dev/shm where they fit (84 MB each at rank 16; 256 of them 21 GB).
    need = count * adapter_bytes(LLAMA3_8B, args.rank, MODULES) if big else 0
    with temporary_root(need, prefix="bench-engine-") if big else tempfile.TemporaryDirectory() as tmp:
        if args.adapter_sweep:
            results = bench_sweep(args, Path(tmp))
        else:
            results = (bench_llama3_8b if big else bench_cpu)(args, Path(tmp))
    if not args.adapter_sweep:
        results["lora_over_base"] = results["engine_lora_step_ms"] / results["engine_base_step_ms"]
    if "peft_mixed_step_ms" in results:
        results["peft_over_engine_lora"] = results["peft_mixed_step_ms"] / results["engine_lora_step_ms"]
    peft_all = f"peft_mixed_{args.adapters}_forward_ms"
    if peft_all in results:
        results["peft_over_engine_lora"] = results[peft_all] / results["engine_lora_step_ms"]
    info = {
        "shape": args.shape, "batch": args.batch, "adapters": args.adapter_sweep or args.adapters, "rank": args.rank,
        "context": args.context,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine(),
        "card": card(), **args.bandwidth,
        "threads": args.threads, "torch": torch.__version__, "tensor_parallel_size": args.tensor_parallel_size,
        "quantization": args.quantization or "none",
    }
    for key, value in {**info, **results}.items():
        print(f"{key:32s} {value:.3f}" if isinstance(value, float) else f"{key:32s} {value}")
    if args.json:
        args.json.write_text(json.dumps({**info, **results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
