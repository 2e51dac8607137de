"""Multi-LoRA kernel benchmark on one CUDA GPU: our Triton op against the base GEMM and two baselines.

For each projection (4096x4096 and 4096x14336, bf16), token count T, number of distinct adapters
and rank, it times in one run:

- ``base``: the projection's GEMM ``x @ W^T``;
- ``ours``: ``kernels.lora_apply`` (split-K shrink + expand) with the step's metadata already
  prepared (``prepare`` runs once per step for all 224 LoRA layers of an 8B model; timed on its own);
- ``gather+bmm``: every token's A and B gathered, two batched matmuls;
- ``loop``: a PEFT-style loop over adapters (index the adapter's tokens, two matmuls, index-add);

eagerly (CUDA events around each call, so host launch overhead counts) and as replays of a
captured CUDA graph (device time only; gather+bmm only for decode sizes, T <= 256). Bandwidth is
reported on the bytes the LoRA op must move at least (the distinct adapters' A and B, plus reading
x and reading and writing y) over the graph time.

With ``--sweep``, it first times the kernels of the target cases alone, as graph replays, under
several launch configurations (the tables in kernels/triton_lora.py are chosen from such a
sweep); ``--tune`` also puts each table entry's fastest configuration into those tables for the
rest of the run, so the table that follows measures them. ``--precompile N`` compiles the sweep's
kernels in N processes first (Triton's disk cache then serves the timing process). (bench/kernels_pooled.py
times the decode launch configurations on the engine's own layout, row pools.) With ``--cpu``
it instead times the torch reference's two strategies on CPU (fp32), which sets
``kernels.cpu_lora.DENSE_MAX_MACS``.

    python bench/kernels.py [--out DIR] [--quick] [--sweep [--tune]] [--precompile N] [--no-table]
    python bench/kernels.py --cpu
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import multiprocessing
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Run as a script, this file's folder heads sys.path and its name would shadow the kernels package.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels import LoRAMeta, lora_apply  # noqa: E402
from kernels import cpu_lora, triton_lora  # noqa: E402

from bench.card import card  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336)]
TOKENS = [1, 16, 64, 256, 4096]
ADAPTERS = [1, 8, 32, 128]
RANKS = [16, 64]
NUM_SLOTS = 128  # the engine's max_loras: slot tensors are this big whatever the mix
DTYPE = torch.bfloat16
GRAPH_MAX_TOKENS = 256  # gather+bmm is captured in a graph up to this many tokens


def median_ms(fn: Callable[[], object]) -> float:
    """Median time of ``fn`` in ms; do_bench flushes the L2 cache before every call."""
    return float(do_bench(fn, warmup=2, rep=15, return_mode="median"))


def graph_ms(fn: Callable[[], object]) -> float:
    """Median time of one replay of ``fn`` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def copy_bandwidth() -> float:
    """Achieved device-to-device copy bandwidth in GB/s (bytes read + written), the practical ceiling."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def bench_case(hidden: int, width: int, tokens: int, adapters: int, rank: int, weights: dict) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(tokens * 131 + adapters)
    x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE, generator=gen)
    y = torch.randn(tokens, width, device="cuda", dtype=DTYPE, generator=gen)
    W, A, B, scaling = weights["W"], weights["A"], weights["B"], weights["scaling"]
    # Distinct adapters spread over the slot pool; tokens dealt round-robin so each has ~T/N tokens.
    used = torch.randperm(NUM_SLOTS, device="cuda", generator=gen)[:adapters]
    slots = used[torch.arange(tokens, device="cuda") % adapters]
    slots = slots[torch.randperm(tokens, device="cuda", generator=gen)]
    meta = LoRAMeta(tokens, NUM_SLOTS, "cuda").prepare(slots)

    slots_long = slots.long()
    groups = [(s, (slots_long == s).nonzero().squeeze(1)) for s in used.tolist()]

    def base() -> None:
        torch.nn.functional.linear(x, W)

    def ours() -> None:
        lora_apply(y, x, A, B, scaling, meta)

    def gather_bmm() -> None:
        h = torch.bmm(A[slots_long], x.unsqueeze(-1))
        delta = torch.bmm(B[slots_long], h).squeeze(-1)
        y.add_(delta * scaling[slots_long].unsqueeze(-1).to(DTYPE))

    def loop() -> None:
        for s, idx in groups:
            out = (x[idx] @ A[s].T) @ B[s].T
            y.index_add_(0, idx, out * scaling[s].to(DTYPE))

    # Correctness at this size: ours against the gather+bmm baseline (both from the same y).
    y0 = y.clone()
    ours()
    y_ours = y.clone()
    y.copy_(y0)
    gather_bmm()
    delta_ref = (y.float() - y0.float()).norm()
    rel_err = ((y_ours.float() - y.float()).norm() / delta_ref.clamp(min=1e-30)).item()
    y.copy_(y0)

    row = dict(hidden=hidden, width=width, tokens=tokens, adapters=adapters, rank=rank, rel_err=rel_err)
    row["base_ms"] = median_ms(base)
    row["ours_ms"] = median_ms(ours)
    row["prepare_ms"] = median_ms(lambda: meta.prepare(slots))
    row["gather_bmm_ms"] = median_ms(gather_bmm)
    row["loop_ms"] = median_ms(loop)
    row["graph_base_ms"] = graph_ms(base)
    row["graph_ours_ms"] = graph_ms(ours)
    row["graph_prepare_ms"] = graph_ms(lambda: meta.prepare(slots))
    if tokens <= GRAPH_MAX_TOKENS:
        row["graph_gather_bmm_ms"] = graph_ms(gather_bmm)
    adapter_bytes = adapters * rank * (hidden + width) * 2
    io_bytes = tokens * hidden * 2 + 2 * tokens * width * 2
    ours_ms = row["graph_ours_ms"]
    row["adapter_bytes"] = adapter_bytes
    row["adapter_gbps"] = adapter_bytes / ours_ms / 1e6
    row["total_gbps"] = (adapter_bytes + io_bytes) / ours_ms / 1e6
    return row


def fmt_row(r: dict) -> str:
    g = lambda key: f"{r[key] * 1000:.1f}" if key in r else "–"  # noqa: E731  (µs)
    return (
        f"| {r['hidden']}x{r['width']} | {r['tokens']} | {r['adapters']} | {r['rank']} "
        f"| {g('base_ms')} | {g('ours_ms')} | {g('gather_bmm_ms')} | {g('loop_ms')} "
        f"| {g('graph_base_ms')} | {g('graph_ours_ms')} | {g('graph_gather_bmm_ms')} "
        f"| {100 * r['graph_ours_ms'] / r['graph_base_ms']:.0f} % | {100 * r['ours_ms'] / r['base_ms']:.0f} % "
        f"| {r['loop_ms'] / r['ours_ms']:.0f}x | {r['gather_bmm_ms'] / r['ours_ms']:.1f}x "
        f"| {r['adapter_gbps']:.0f} | {r['total_gbps']:.0f} | {g('graph_prepare_ms')} | {r['rel_err']:.1e} |"
    )


HEADER = (
    "| projection | T | adapters | rank | base µs | ours µs | gather+bmm µs | loop µs "
    "| graph: base µs | graph: ours µs | graph: gather+bmm µs "
    "| ours / base (graph) | ours / base (eager) | loop / ours (eager) | gather / ours (eager) "
    "| adapter GB/s | total GB/s | graph: prepare µs | rel. err |\n"
    + "| --- " * 19
    + "|"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="directory for kernels_bench.json and .md")
    parser.add_argument("--quick", action="store_true", help="only the target rows' sizes")
    parser.add_argument("--sweep", action="store_true", help="first time launch configurations of the target cases")
    parser.add_argument("--tune", action="store_true", help="run the table with the sweep's fastest configurations")
    parser.add_argument("--precompile", type=int, default=0, metavar="N", help="compile the sweep in N processes")
    parser.add_argument("--no-table", action="store_true", help="skip the table (sweep only)")
    parser.add_argument("--cpu", action="store_true", help="time the torch reference's strategies on CPU instead")
    args = parser.parse_args()
    if args.cpu:
        cpu_strategies()
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels.py needs a CUDA device (or --cpu)")

    started = time.time()
    props = torch.cuda.get_device_properties(0)
    env = dict(
        device=props.name, sms=props.multi_processor_count, torch=torch.__version__, triton=triton.__version__,
        python=platform.python_version(), date=time.strftime("%Y-%m-%d"),
    )  # fmt: skip
    if args.precompile:
        precompile(args.precompile)
        env["precompile_s"] = time.time() - started
    env["copy_gbps"] = copy_bandwidth()
    print(f"# {env}", flush=True)
    sweeps: list[dict] = []
    if args.sweep:
        sweeps = sweep(args.tune)
        env["tables"] = {name: _as_json(table) for name, table in tables().items()}
        save(args.out, env, [], sweeps)
    rows = [] if args.no_table else run_table(args.quick, args.out, env, sweeps)
    env["seconds"] = time.time() - started
    save(args.out, env, rows, sweeps)


def run_table(quick: bool, out: Path | None, env: dict, sweeps: list[dict]) -> list[dict]:
    rows = []
    for hidden, width in SHAPES:
        for rank in RANKS:
            gen = torch.Generator(device="cuda").manual_seed(rank)
            weights = dict(
                W=torch.randn(width, hidden, device="cuda", dtype=DTYPE, generator=gen) / math.sqrt(hidden),
                A=torch.randn(NUM_SLOTS, rank, hidden, device="cuda", dtype=DTYPE, generator=gen) / math.sqrt(hidden),
                B=torch.randn(NUM_SLOTS, width, rank, device="cuda", dtype=DTYPE, generator=gen) / math.sqrt(rank),
                scaling=torch.full((NUM_SLOTS,), 2.0, device="cuda"),
            )
            for tokens in TOKENS:
                for adapters in ADAPTERS:
                    if adapters > tokens:
                        continue
                    if quick and (tokens, adapters) not in {(64, 32), (4096, 8), (256, 128), (1, 1)}:
                        continue
                    row = bench_case(hidden, width, tokens, adapters, rank, weights)
                    rows.append(row)
                    print(fmt_row(row), flush=True)
                    save(out, env, rows, sweeps)
            del weights
            torch.cuda.empty_cache()
    print(HEADER + "\n" + "\n".join(fmt_row(r) for r in rows), flush=True)
    return rows


def save(out: Path | None, env: dict, rows: list[dict], sweeps: list[dict]) -> None:
    """Write what has been measured so far (a run cut short still leaves its rows)."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels_bench.json").write_text(json.dumps(dict(env=env, card=card(), rows=rows, sweeps=sweeps), indent=1))
    table = HEADER + "\n" + "\n".join(fmt_row(r) for r in rows)
    (out / "kernels_bench.md").write_text(f"{env}\n\n{table}\n")


def cpu_strategies() -> None:
    """Median µs of the reference's all-slots GEMM strategy and its per-slot loop, fp32 on CPU."""

    def cpu_ms(fn: Callable[[], object], repeat: int = 30) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2] * 1000

    print(f"# CPU, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| T | slots | rank | K | N | all-slots GEMMs µs | per-slot loop µs | base GEMM µs | prepare µs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for tokens, slots, rank, hidden, width in [
        (32, 8, 16, 64, 64), (32, 8, 16, 256, 256), (32, 16, 16, 256, 768), (128, 8, 16, 256, 256),
        (256, 8, 16, 1024, 1024), (512, 8, 64, 256, 256), (2048, 8, 16, 256, 256),
    ]:  # fmt: skip
        gen = torch.Generator().manual_seed(tokens)
        token_slots = torch.randint(-1, slots, (tokens,), generator=gen)
        x, y = torch.randn(tokens, hidden, generator=gen), torch.randn(tokens, width, generator=gen)
        A, B = torch.randn(slots, rank, hidden, generator=gen), torch.randn(slots, width, rank, generator=gen)
        W, scaling = torch.randn(width, hidden, generator=gen), torch.rand(slots, generator=gen)
        meta = LoRAMeta(tokens, slots).prepare(token_slots)
        timings = []
        for threshold in (1 << 62, 0):
            cpu_lora.DENSE_MAX_MACS = threshold
            timings.append(cpu_ms(lambda: lora_apply(y, x, A, B, scaling, meta)))
        base = cpu_ms(lambda: torch.nn.functional.linear(x, W))
        prep = cpu_ms(lambda: meta.prepare(token_slots))
        print(f"| {tokens} | {slots} | {rank} | {hidden} | {width} | {timings[0] * 1000:.0f} | {timings[1] * 1000:.0f} "
              f"| {base * 1000:.0f} | {prep * 1000:.0f} |")  # fmt: skip


# (hidden, width, tokens, adapters, rank) of the targets' rows in shared/targets.md, and one token
# (the fixed cost of a decode launch).
DECODE_CASES = [
    (4096, 4096, 64, 32, 16),
    (4096, 4096, 256, 128, 16),
    (4096, 14336, 256, 128, 16),
    (4096, 4096, 1, 1, 16),
    (4096, 4096, 256, 128, 64),
]
PREFILL_CASE = (4096, 4096, 4096, 8, 16)


def tables() -> dict[str, object]:
    return dict(
        DECODE_SHRINK_PROGRAMS=triton_lora.DECODE_SHRINK_PROGRAMS, DECODE_EXPAND=triton_lora.DECODE_EXPAND,
        PREFILL_SHRINK=triton_lora.PREFILL_SHRINK, PREFILL_EXPAND=triton_lora.PREFILL_EXPAND,
    )  # fmt: skip


def _as_json(table: object) -> object:
    if isinstance(table, dict):
        return {k: dataclasses.asdict(v) for k, v in table.items()}
    return table


def sweep_variants() -> dict[str, list]:
    """Launch configurations the sweep times, by table entry. A decode shrink + expand variant is
    ``{"shrink_programs": ..., "expand": ExpandConfig}``."""
    S, E = triton_lora.ShrinkConfig, triton_lora.ExpandConfig
    sms, one = 132, triton_lora.ONE_BLOCK_EACH
    decode_expands = [
        E(16, block_n, programs, prefetch, 4, 1)
        for block_n, programs, prefetch in [(64, one, False), (128, one, False), (256, one, False),
                                            (64, 8 * sms, True), (128, 8 * sms, True), (128, 16 * sms, True)]
    ]  # fmt: skip
    decode_split = [
        dict(shrink_programs=programs, expand=expand) for programs in (4 * sms, 8 * sms, 16 * sms)
        for expand in decode_expands
    ]  # fmt: skip
    shrink16 = [S(64, 128, 4, 8, 4), S(64, 128, 4, 4, 3), S(64, 64, 4, 4, 3), S(64, 128, 8, 8, 4)]
    expand16 = [
        E(block_m, block_n, programs, True, warps, 1)
        for block_m, block_n, warps in [(64, 64, 4), (16, 128, 4), (64, 128, 8)]
        for programs in (8 * sms, 16 * sms)
    ]  # fmt: skip
    return dict(decode_split=decode_split, shrink16=shrink16, expand16=expand16)


def _sweep_case(hidden: int, width: int, tokens: int, adapters: int, rank: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(7)
    case = dict(
        x=torch.randn(tokens, hidden, device="cuda", dtype=DTYPE, generator=gen),
        y=torch.randn(tokens, width, device="cuda", dtype=DTYPE, generator=gen),
        A=torch.randn(NUM_SLOTS, rank, hidden, device="cuda", dtype=DTYPE, generator=gen) / math.sqrt(hidden),
        B=torch.randn(NUM_SLOTS, width, rank, device="cuda", dtype=DTYPE, generator=gen) / math.sqrt(rank),
        scaling=torch.full((NUM_SLOTS,), 2.0, device="cuda"),
    )
    case["y0"] = case["y"].clone()  # sweeps add into y in place; correctness checks restart from here
    used = torch.randperm(NUM_SLOTS, device="cuda", generator=gen)[:adapters]
    slots = used[torch.arange(tokens, device="cuda") % adapters]
    slots = slots[torch.randperm(tokens, device="cuda", generator=gen)]
    case["meta"] = LoRAMeta(tokens, NUM_SLOTS, "cuda").prepare(slots)
    return case


def _jobs() -> list[tuple[tuple, str, object]]:
    """(case, kernel, config) for every timing of the sweep."""
    variants = sweep_variants()
    jobs = []
    for case in DECODE_CASES:
        jobs += [(case, "shrink+expand", config) for config in variants["decode_split"]]
    jobs += [(PREFILL_CASE, "shrink", config) for config in variants["shrink16"]]
    jobs += [(PREFILL_CASE, "expand", config) for config in variants["expand16"]]
    return jobs


def _run(kernel: str, c: dict, config: object, shrink_config: object = None) -> Callable[[], None]:
    """The launch of ``kernel`` on case ``c`` under ``config`` as a closure."""
    x, y, A, B, scaling, meta = c["x"], c["y"], c["A"], c["B"], c["scaling"], c["meta"]
    if kernel == "shrink":
        return lambda: triton_lora.shrink(x, [A], meta, None, config)
    if kernel == "expand":
        h = triton_lora.shrink(x, [A], meta, None, shrink_config)
        return lambda: triton_lora.expand(y, h, [B], scaling, meta, (0,), None, config)
    sc = triton_lora.shrink_config(meta, x.shape[1], A.shape[1], 1, config["shrink_programs"])
    return lambda: triton_lora.expand(y, triton_lora.shrink(x, [A], meta, None, sc), [B], scaling, meta, (0,), None,
                                      config["expand"])  # fmt: skip


def _config_json(config: object) -> object:
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return {k: _config_json(v) for k, v in config.items()} if isinstance(config, dict) else config


def _compile_shard(shard: int, shards: int) -> int:
    """Compile (run once, untimed) every ``shards``-th job of the sweep, from ``shard``."""
    cases: dict[tuple, dict] = {}
    done = 0
    for case, kernel, config in _jobs()[shard::shards]:
        if case not in cases:
            cases[case] = _sweep_case(*case)
        try:
            _run(kernel, cases[case], config, triton_lora.PREFILL_SHRINK[16])()
            done += 1
        except Exception as error:  # a failing variant is reported (and skipped) by the timed sweep
            print(f"# precompile {kernel} {config}: {type(error).__name__}: {error}", flush=True)
    torch.cuda.synchronize()
    return done


def precompile(processes: int) -> None:
    """Fill Triton's on-disk cache with the sweep's kernels from several processes at once."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
        done = sum(pool.map(_compile_shard, range(processes), [processes] * processes))
    print(f"# precompiled {done} sweep launches in {processes} processes", flush=True)


def sweep(tune: bool) -> list[dict]:
    """Time every job of the sweep as a graph replay (device time); check each decode launch
    against the reference; with ``tune``, put the fastest configurations into the tables."""
    results: list[dict] = []
    cases = {case: _sweep_case(*case) for case in {job[0] for job in _jobs()}}
    reference = {}
    for case, c in cases.items():
        y = c["y0"].clone()
        lora_apply(y, c["x"], c["A"], c["B"], c["scaling"], c["meta"], backend="torch")
        reference[case] = y
    shrink_winner = None
    for kernel in ("shrink+expand", "shrink", "expand"):
        for case, job_kernel, config in _jobs():
            if job_kernel != kernel:
                continue
            c = cases[case]
            row = dict(zip(("hidden", "width", "tokens", "adapters", "rank"), case), kernel=kernel,
                       tiles=c["meta"].grid_tiles(16), config=_config_json(config))  # fmt: skip
            try:
                fn = _run(kernel, c, config, shrink_winner)
                row["ms"] = graph_ms(fn)
                if kernel == "shrink+expand":
                    c["y"].copy_(c["y0"])
                    fn()
                    delta = (reference[case].float() - c["y0"].float()).norm()
                    row["rel_err"] = ((c["y"].float() - reference[case].float()).norm() / delta).item()
            except Exception as error:  # a variant that does not compile or run is reported, not fatal
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            results.append(row)
        if kernel == "shrink":
            shrink_winner = triton_lora.ShrinkConfig(**_fastest(results, "shrink", 16))
    _report(results)
    if tune:
        apply_winners(results)
    return results


def _timed(results: list[dict], kernel: str, rank: int) -> list[dict]:
    return [r for r in results if r["kernel"] == kernel and r["rank"] == rank and "ms" in r
            and r.get("rel_err", 0.0) < 2e-2]  # fmt: skip


def _fastest(results: list[dict], kernel: str, rank: int) -> dict:
    """The configuration (as JSON) of ``kernel`` with the least summed slowdown (time over the
    case's best) across the cases it was timed on, among those timed on all of them."""
    timed = _timed(results, kernel, rank)
    best_per_case: dict[tuple, float] = {}
    for r in timed:
        key = (r["width"], r["tokens"], r["adapters"])
        best_per_case[key] = min(best_per_case.get(key, math.inf), r["ms"])
    score: dict[str, float] = {}
    counts: dict[str, int] = {}
    for r in timed:
        key = json.dumps(r["config"], sort_keys=True)
        score[key] = score.get(key, 0.0) + r["ms"] / best_per_case[(r["width"], r["tokens"], r["adapters"])]
        counts[key] = counts.get(key, 0) + 1
    complete = [k for k in score if counts[k] == max(counts.values())]
    return json.loads(min(complete, key=score.__getitem__))


def apply_winners(results: list[dict]) -> None:
    E = triton_lora.ExpandConfig
    split16 = _fastest(results, "shrink+expand", 16)
    triton_lora.DECODE_SHRINK_PROGRAMS = split16["shrink_programs"]
    triton_lora.DECODE_EXPAND[16] = E(**split16["expand"])
    triton_lora.DECODE_EXPAND[64] = E(**_fastest(results, "shrink+expand", 64)["expand"])
    triton_lora.PREFILL_SHRINK[16] = triton_lora.ShrinkConfig(**_fastest(results, "shrink", 16))
    triton_lora.PREFILL_EXPAND[16] = E(**_fastest(results, "expand", 16))
    for name, table in tables().items():
        print(f"# tuned {name}: {table}", flush=True)


def _report(results: list[dict]) -> None:
    """Per case and kernel: the current table's time (if it was timed), the best and the spread."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["kernel"], r["width"], r["tokens"], r["adapters"], r["rank"]), []).append(r)
    for (kernel, width, tokens, adapters, rank), rows in groups.items():
        ok = [r for r in rows if "ms" in r]
        errors = [r for r in rows if "error" in r]
        head = f"# sweep {kernel} {width}w T{tokens} N{adapters} r{rank}:"
        if not ok:
            print(f"{head} all failed: {errors[0]['error']}", flush=True)
            continue
        best = min(ok, key=lambda r: r["ms"])
        worst_err = max((r.get("rel_err", 0.0) for r in ok), default=0.0)
        worst = max(r["ms"] for r in ok)
        print(f"{head} best {best['ms'] * 1000:.1f} µs {best['config']}; worst {worst * 1000:.1f} µs;"
              f" {len(ok)} ok, {len(errors)} failed, max rel err {worst_err:.1e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
