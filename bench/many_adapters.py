"""Issue 21's many-adapter matrix: adapter count x popularity x GPU adapter budget x request rate.

Each (count, budget) cell is one worker that bench/serve.py launches, primes (one short request per
adapter, so that no run pays every adapter's first load) and then runs every popularity x rate
against, in that order. A run starts with the worker idle, after a warm-up drawn from its own
popularity; its worker figures (GPU hit rate, adapter loads and bytes moved per second, evictions)
are /metrics deltas over its window, and what the GPU holds carries over from the run before: a
worker cannot be reset without a restart, and a restart per run would cost more device time than
the runs. Budgets: ``unlimited`` gives the worker no --max-loras (its own default: as many adapters
as its adapter memory holds), ``eighth`` gives ``--max-loras N/8`` (room for an eighth of them).

Device time is scarce, so the adapters are written once, in parallel, before the first worker, and
the cells run by priority while time is left (``--time-limit``): the targets' cells first (32 and
256 adapters unlimited, then 1,024 with room for an eighth), then the rest by count descending; a
cell starts only if its worker's start and first run fit in the time left, and it is stopped at the
limit (the runs it finished are kept). The estimate is printed first; each cell prints its real
start-up beside it.

Output: JSON of every cell and run (``--json``), and a markdown table for docs/benchmarks.md with
issue 21's targets evaluated from the runs where they apply (``--markdown``).

    python bench/many_adapters.py --json OUT/many_adapters.json --markdown OUT/many_adapters.md
    python bench/many_adapters.py --cells 1024/unlimited,256/eighth,32/eighth --json OUT/rest.json  # a second call
    python bench/many_adapters.py --report first.json rest.json --markdown matrix.md      # both, no device
    python bench/many_adapters.py --launch tiny --counts 8,32 --rates 2,4 --num-prompts 24 \\
        --random-input-len 64 --random-output-len 16 --json /tmp/m.json --markdown /tmp/m.md
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder heads sys.path; the repository root must be there instead.
sys.path[0] = str(ROOT)

from bench.random_adapters import (  # noqa: E402
    MODULE_SETS, adapter_bytes, adapter_paths, adapter_set, shape_config, temporary_root,
)
from bench.serve import POPULARITIES  # noqa: E402
from bench.card import card  # noqa: E402

BUDGETS = ("unlimited", "eighth")
STATE_BETWEEN_RUNS = (
    "one worker per (adapters, budget), primed with one request per adapter; its runs in the order listed, each "
    "starting idle after a warm-up drawn from its own popularity; worker figures are /metrics deltas over the "
    "run; the GPU's adapters carry over from the run before"
)


@dataclass(frozen=True)
class Costs:
    """Seconds the estimate assumes, by shape. Rough until a run on the machine says otherwise: each
    cell prints its real start-up and priming beside their estimates, to correct these."""

    startup: float  # serve.py's start to its worker's ready, adapters aside: weights, KV cache, graphs
    load: float  # per adapter read at start (--lora-modules, one after another) ...
    load_per_mb: float  # ... and per MB of it: read, digest, convert, pin, checksum
    prime: float  # per adapter primed (its first copy to the GPU and a one-token request)
    write_per_mb: float  # per MB of adapter written, per writer process
    drain: float  # a run's tail after its last arrival (the last outputs), and the settle
    warmup: float
    stop: float  # the worker's shutdown

    def load_s(self, mb: float) -> float:
        return self.load + mb * self.load_per_mb


# 8B, measured on the H200 (2026-12-02, the adapter-memory rewrite in progress): 256 rank-16
# all-projection adapters (84 MB) written in 31 s by 16 processes (1.9 s each per process) and read
# in 83 s by the worker's 2 loader threads (0.65 s each per thread: 7.7 ms per MB); the engine
# bench's 72 graphs took 13-18 s to capture; a run's last outputs (128 tokens) take 2-5 s.
COSTS = {
    "llama3-8b": Costs(startup=45.0, load=0.01, load_per_mb=0.0077, prime=0.02, write_per_mb=0.023, drain=6.0,
                       warmup=2.0, stop=8.0),
    "small": Costs(startup=30.0, load=0.02, load_per_mb=0.01, prime=0.01, write_per_mb=0.05, drain=5.0, warmup=2.0,
                   stop=4.0),
    "tiny": Costs(startup=20.0, load=0.02, load_per_mb=0.01, prime=0.01, write_per_mb=0.05, drain=4.0, warmup=1.0,
                  stop=3.0),
}  # fmt: skip


@dataclass(frozen=True)
class Cell:
    count: int
    budget: str

    @property
    def max_loras(self) -> int:
        """bench/serve.py's --max-loras: 0 leaves the worker its default."""
        return 0 if self.budget == "unlimited" else max(1, self.count // 8)

    @property
    def label(self) -> str:
        return "unlimited (worker default)" if self.budget == "unlimited" else f"eighth (--max-loras {self.max_loras})"


def cell_order(counts: list[int], budgets: list[str]) -> list[Cell]:
    """The targets' cells first: the two smallest counts unlimited (the first target: 256 against
    32), then the largest count limited (the second and third: 1,024 with room for an eighth,
    against the largest all-resident run), then the rest by count descending, unlimited first."""
    cells = [Cell(n, b) for n in counts for b in budgets]
    ascending = sorted(counts)
    first = [Cell(n, "unlimited") for n in ascending[:2]] + [Cell(ascending[-1], b) for b in budgets if b != "unlimited"]
    rest = sorted((c for c in cells if c not in first), key=lambda c: (-c.count, c.budget != "unlimited"))
    return [c for c in first if c in cells] + rest


def run_seconds(args: argparse.Namespace, costs: Costs, rate: float) -> float:
    return costs.warmup + args.num_prompts / rate + costs.drain


def cell_seconds(args: argparse.Namespace, costs: Costs, cell: Cell, runs: int | None = None) -> float:
    """The estimate of one cell: its worker's start, priming, ``runs`` of its runs (all by default)
    and its stop."""
    plan = [rate for rate in args.rates for _ in args.popularities]  # serve.py's order
    return (costs.startup + cell.count * (costs.load_s(args.adapter_mb) + costs.prime) + costs.stop
            + sum(run_seconds(args, costs, rate) for rate in plan[:runs]))  # fmt: skip


def print_estimate(args: argparse.Namespace, costs: Costs, cells: list[Cell], to_write: int) -> dict[str, Any]:
    write_s = to_write * args.adapter_mb * costs.write_per_mb / (os.cpu_count() or 1)
    per_cell = {f"{c.count}/{c.budget}": cell_seconds(args, costs, c) for c in cells}
    total = write_s + sum(per_cell.values())
    print(f"estimate ({args.launch}, {args.adapter_mb:.2f} MB adapters; assumed: worker start {costs.startup:g}s "
          f"+ {costs.load_s(args.adapter_mb):.3f}s per adapter loaded + {costs.prime:g}s per adapter primed, runs of "
          f"{args.num_prompts} prompts at 1/rate s each + {costs.warmup + costs.drain:g}s, stop {costs.stop:g}s; "
          f"{to_write} adapters to write at {costs.write_per_mb:g}s per MB per process, {os.cpu_count()} processes):")
    print(f"  writing adapters {write_s:.0f}s; " + "; ".join(f"{k} {v:.0f}s" for k, v in per_cell.items()))
    limit = f"{args.time_limit:g}s limit" if args.time_limit else "no limit"
    print(f"  total {total:.0f}s ({total / 60:.1f} min), {limit}", flush=True)
    if args.time_limit and total > args.time_limit:
        print("  more than the limit: the cells at the end will be skipped (run them in another call: --cells)",
              flush=True)
    return {"write_s": write_s, "cells_s": per_cell, "total_s": total}


@contextmanager
def stopped_on_exit(process: subprocess.Popen[bytes], grace: float) -> Iterator[None]:
    """Stops ``process`` (bench/serve.py, in a session of its own, and its worker) if the block
    leaves it running: SIGTERM, on which it stops its worker; its whole group killed after ``grace``."""
    try:
        yield
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def run_cell(args: argparse.Namespace, cell: Cell, cache: Path, out: Path, seconds: float | None,
             costs: Costs) -> dict[str, Any]:
    """One cell through bench/serve.py, stopped after ``seconds`` (None: not); its record."""
    command = [
        sys.executable, str(ROOT / "bench" / "serve.py"), "--launch", args.launch, "--num-adapters", str(cell.count),
        "--max-loras", str(cell.max_loras), "--prime", "--popularity", ",".join(args.popularities),
        "--zipf-alpha", str(args.zipf_alpha), "--request-rate", ",".join(f"{r:g}" for r in args.rates),
        "--num-prompts", str(args.num_prompts), "--warmup", str(args.warmup), "--run-time-limit", str(args.run_time_limit),
        "--random-input-len", str(args.random_input_len), "--random-output-len", str(args.random_output_len),
        "--rank", str(args.rank), "--adapter-modules", args.adapter_modules, "--adapter-cache", str(cache),
        "--max-num-seqs", str(args.max_num_seqs), "--seed", str(args.seed), "--json", str(out),
    ]  # fmt: skip
    if args.lora_memory_bytes is not None:
        command += ["--lora-memory-bytes", str(args.lora_memory_bytes)]
    worker_args = f"{args.worker_args} --borrow-kv-memory".strip() if args.borrow_kv_memory else args.worker_args
    if worker_args:
        command.append(f"--worker-args={worker_args}")
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=ROOT, start_new_session=True)
    # serve.py's stop: its runs' connections close (the worker aborts their requests), then the worker's.
    with stopped_on_exit(process, grace=costs.stop + 30):
        try:
            code: int | None = process.wait(seconds)
        except subprocess.TimeoutExpired:
            code = None
    record = json.loads(out.read_text()) if out.exists() else {}
    runs = record.get("runs") or ([{k: v for k, v in record.items() if k not in ("args", "host", "python", "launch")}]
                                  if "popularity" in record else [])  # fmt: skip
    status = "done" if code == 0 else "stopped at the time limit" if code is None else f"exit code {code}"
    return {"count": cell.count, "budget": cell.budget, "max_loras": cell.max_loras, "label": cell.label,
            "status": status, "seconds": time.monotonic() - started, "launch": record.get("launch"), "runs": runs}


# ---- the table and the targets -------------------------------------------------------------------


def _ms(run: dict[str, Any], key: str) -> str:
    return f"{run[key]:.0f}" if key in run else "-"


def _na(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, spec)


def markdown_table(cells: list[dict[str, Any]]) -> str:
    lines = [
        "| adapters | popularity | GPU adapter budget | offered req/s | output tok/s | TTFT p50 / p99 (ms) "
        "| TPOT p50 (ms) | achieved req/s | GPU hit rate | loads/s | MB/s host→GPU | failed |",
        "| ---: | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for cell in cells:
        for run in cell["runs"]:
            w = run.get("worker", {})
            cut = w.get("cut", 0)
            failed = f"{run['failed']}" + (f" ({cut} cut)" if cut else "")
            lines.append(
                f"| {cell['count']:,} | {run['popularity']} | {cell['label']} | {run['request_rate']:g} "
                f"| {run['output_token_throughput']:,.0f} | {_ms(run, 'median_ttft_ms')} / {_ms(run, 'p99_ttft_ms')} "
                f"| {run['median_tpot_ms']:.1f} | {run['request_throughput']:.1f} "
                f"| {_na(w.get('gpu_hit_rate'), '.1f', 100)} % | {_na(w.get('adapter_loads_per_s'), '.1f')} "
                f"| {_na(w.get('bytes_moved_per_s'), ',.1f', 1e-6)} | {failed} |"
                if "median_tpot_ms" in run else
                f"| {cell['count']:,} | {run['popularity']} | {cell['label']} | {run['request_rate']:g} | no request "
                f"completed | | | | | | | {failed} |"
            )  # fmt: skip
    return "\n".join(lines)


Runs = dict[tuple[int, str, str, float], dict[str, Any]]


def _completed(run: dict[str, Any]) -> bool:
    """Whether the run completed requests (latency figures exist only then)."""
    return "median_ttft_ms" in run and "median_tpot_ms" in run


def _fits(run: dict[str, Any]) -> bool:
    """Whether the run's adapters all stayed on the GPU: no eviction in its window."""
    return run.get("worker", {}).get("slot_evictions") == 0


def evaluate_targets(cells: list[dict[str, Any]], counts: list[int], rates: list[float]) -> list[dict[str, str]]:
    """Issue 21's targets, from the runs that bear on each; a target whose runs are missing is n/a.

    1. Each count above the smallest, unlimited and all fitting (no eviction in its window): output
       tok/s >= 95 % and TPOT p50 <= 1.2 x the smallest count's, same popularity and rate (the issue:
       256 against 32).
    2. The largest count with room for an eighth, uniform, highest rate (the issue: 1,024, 32 req/s):
       no failed request, TTFT p50 <= 3 x and output tok/s >= 80 % of the all-resident case: the
       unlimited run at that popularity and rate with the most adapters and no eviction.
    3. Zipf better than uniform where an eighth fits: lower TTFT p50 and a higher GPU hit rate, at each
       rate.
    """
    runs: Runs = {(c["count"], c["budget"], r["popularity"], r["request_rate"]): r for c in cells for r in c["runs"]}
    results: list[dict[str, str]] = []

    def add(target: str, ok: bool | None, detail: str) -> None:
        results.append({"target": target, "verdict": "n/a" if ok is None else "met" if ok else "not met", "detail": detail})

    small, top_rate = min(counts), max(rates)
    for (count, budget, popularity, rate), run in sorted(runs.items()):
        if count == small or budget != "unlimited":
            continue
        name = f"{count} vs {small} adapters, unlimited, {popularity}, {rate:g} req/s: tok/s >= 95 %, TPOT p50 <= 1.2 x"
        ref = runs.get((small, "unlimited", popularity, rate))
        if ref is None or not _completed(ref):
            add(name, None, f"no {small}-adapter run that completed requests")
        elif not _completed(run):
            add(name, False, "no request completed")
        elif not _fits(run):
            add(name, None, f"not all fitting: {run['worker'].get('slot_evictions')} GPU evictions in the window")
        else:
            tok = run["output_token_throughput"] / ref["output_token_throughput"]
            tpot = run["median_tpot_ms"] / ref["median_tpot_ms"]
            add(name, tok >= 0.95 and tpot <= 1.2, f"tok/s {tok:.1%} of {small}'s, TPOT p50 {tpot:.2f} x")
    big = max(counts)
    name = f"{big} adapters, room for an eighth, uniform, {top_rate:g} req/s: no failure, TTFT p50 <= 3 x, tok/s >= 80 %"
    limited = runs.get((big, "eighth", "uniform", top_rate))
    resident = [(count, r) for (count, budget, p, rate), r in runs.items()
                if budget == "unlimited" and p == "uniform" and rate == top_rate and _completed(r) and _fits(r)]
    if limited is None or not resident:
        add(name, None, "no such run" if limited is None else "no all-resident run at that rate")
    elif not _completed(limited):
        add(name, False, "no request completed")
    else:
        count, ref = max(resident, key=lambda item: item[0])
        ttft = limited["median_ttft_ms"] / ref["median_ttft_ms"]
        tok = limited["output_token_throughput"] / ref["output_token_throughput"]
        add(name, limited["failed"] == 0 and ttft <= 3 and tok >= 0.8,
            f"{limited['failed']} failed, TTFT p50 {ttft:.2f} x and tok/s {tok:.1%} of the all-resident {count}-adapter run")
    for (count, budget, popularity, rate), zipf in sorted(runs.items()):
        if budget != "eighth" or popularity != "zipf":
            continue
        name = f"{count} adapters, room for an eighth, {rate:g} req/s: Zipf better than uniform"
        uniform = runs.get((count, budget, "uniform", rate))
        if uniform is None or not (_completed(zipf) and _completed(uniform)):
            add(name, None, "no uniform run" if uniform is None else "no request completed in one of the two")
            continue
        zipf_hits, uniform_hits = (r.get("worker", {}).get("gpu_hit_rate") for r in (zipf, uniform))
        ok = None if zipf_hits is None or uniform_hits is None else (
            zipf_hits > uniform_hits and zipf["median_ttft_ms"] < uniform["median_ttft_ms"])
        add(name, ok, f"TTFT p50 {zipf['median_ttft_ms']:.0f} vs {uniform['median_ttft_ms']:.0f} ms, GPU hit rate "
            f"{_na(zipf_hits, '.1f', 100)} vs {_na(uniform_hits, '.1f', 100)} %")
    return results


def _header(config: dict[str, Any]) -> str:
    return (f"{config['launch']}, rank-{config['rank']} adapters on {config['adapter_modules']} projections, Poisson "
            f"arrivals, {config['num_prompts']} requests a run, prompt ~{config['random_input_len']} and output "
            f"{config['random_output_len']} tokens; {STATE_BETWEEN_RUNS}.")  # fmt: skip


def write_outputs(json_path: Path | None, markdown_path: Path | None, config: dict[str, Any],
                  cells: list[dict[str, Any]], extra: dict[str, Any]) -> list[dict[str, str]]:
    """The JSON of every cell and run and the markdown of the table and the targets; the targets."""
    counts = sorted({c["count"] for c in cells})
    rates = sorted({r["request_rate"] for c in cells for r in c["runs"]})
    targets = evaluate_targets(cells, counts, rates) if counts and rates else []
    if json_path:
        json_path.write_text(json.dumps({"config": config, "card": card(), "state_between_runs": STATE_BETWEEN_RUNS, **extra,
                                         "cells": cells, "targets": targets}, indent=2, default=str))  # fmt: skip
    if markdown_path:
        skipped = [f"{c['count']} adapters, {c['label']}: {c['status']}" for c in cells if c["status"] != "done"]
        verdicts = [f"- {t['target']}: **{t['verdict']}** ({t['detail']})" for t in targets]
        markdown_path.write_text("\n\n".join(
            [_header(config), markdown_table(cells), *(["Not complete: " + "; ".join(skipped) + "."] if skipped else []),
             "Targets (issue 21):\n\n" + "\n".join(verdicts)]) + "\n")  # fmt: skip
    return targets


def print_results(cells: list[dict[str, Any]], targets: list[dict[str, str]]) -> None:
    print("\n" + markdown_table(cells) + "\n")
    for target in targets:
        print(f"{target['verdict']:>8}: {target['target']} ({target['detail']})")


def run_matrix(args: argparse.Namespace, cells: list[Cell]) -> list[dict[str, Any]]:
    """Every cell that fits in the time left, in order; their records."""
    costs = COSTS[args.launch]
    config = {k: v for k, v in vars(args).items() if k not in ("json", "markdown", "report")}
    started = time.monotonic()
    count = max(c.count for c in cells)
    need = count * int(args.adapter_mb * 1e6)
    with (nullcontext(str(args.adapter_cache)) if args.adapter_cache
          else temporary_root(need, prefix="bench-adapters-")) as cache_dir:  # fmt: skip
        cache = Path(cache_dir)
        paths = adapter_paths(cache, args.launch, count=count, rank=args.rank, modules=args.adapter_modules)
        estimate = print_estimate(args, costs, cells, sum(not path.is_dir() for path in paths))
        # All at once, before the first worker: every cell's are the first N of these.
        _, written = adapter_set(cache, args.launch, count=count, rank=args.rank, modules=args.adapter_modules)
        print(f"{written} adapters written in {time.monotonic() - started:.0f}s under {cache}; {STATE_BETWEEN_RUNS}",
              flush=True)
        done: list[dict[str, Any]] = []
        with tempfile.TemporaryDirectory(prefix="bench-cells-") as records:
            for cell in cells:
                left = args.time_limit - (time.monotonic() - started) if args.time_limit else float("inf")
                # Not enough left for the worker's start, priming, its first run and its stop.
                first = cell_seconds(args, costs, cell, runs=1)
                if first > left:
                    done.append({"count": cell.count, "budget": cell.budget, "max_loras": cell.max_loras, "label": cell.label,
                                 "status": f"skipped: its start and first run need ~{first:.0f}s, {left:.0f}s left",
                                 "seconds": 0.0, "launch": None, "runs": []})  # fmt: skip
                    print(f"=== {cell.count} adapters, {cell.label}: {done[-1]['status']}", flush=True)
                    continue
                expected = cell_seconds(args, costs, cell)
                room = f"{left:.0f}s left" if args.time_limit else "no limit"
                print(f"=== {cell.count} adapters, {cell.label}: estimate {expected:.0f}s, {room}", flush=True)
                record = run_cell(args, cell, cache, Path(records) / f"{cell.count}-{cell.budget}.json",
                                  left - costs.stop if args.time_limit else None, costs)  # fmt: skip
                launch = record["launch"] or {}
                print(f"=== {cell.count} adapters, {cell.label}: {record['status']} in {record['seconds']:.0f}s "
                      f"(estimate {expected:.0f}s); worker start {launch.get('ready_s', float('nan')):.0f}s (estimate "
                      f"{costs.startup + cell.count * costs.load_s(args.adapter_mb):.0f}s), priming "
                      f"{launch.get('prime_s', float('nan')):.0f}s (estimate {cell.count * costs.prime:.0f}s)",
                      flush=True)  # fmt: skip
                done.append(record)
                extra = {"estimate": estimate, "elapsed_s": time.monotonic() - started}
                write_outputs(args.json, args.markdown, config, done, extra)
    targets = write_outputs(args.json, args.markdown, config, done,
                            {"estimate": estimate, "elapsed_s": time.monotonic() - started})
    print_results(done, targets)
    print(f"matrix done in {time.monotonic() - started:.0f}s (estimate {estimate['total_s']:.0f}s)")
    return done


def report(args: argparse.Namespace) -> int:
    """The table and the targets from earlier runs' JSON (a matrix split over device calls): their
    cells together, a later file's cell replacing an earlier one's of the same count and budget."""
    records = [json.loads(path.read_text()) for path in args.report]
    cells: dict[tuple[int, str], dict[str, Any]] = {}
    for record in records:
        cells.update({(c["count"], c["budget"]): c for c in record["cells"] if c["runs"]})
    merged = list(cells.values())
    targets = write_outputs(args.json, args.markdown, records[0]["config"], merged, {"merged_from": args.report})
    print_results(merged, targets)
    return 0


# ---- the command line -------------------------------------------------------------------------


def _list(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        return [kind(item) for item in text.split(",")]

    return parse


def _budget(text: str) -> str:
    if text not in BUDGETS:
        raise ValueError(text)
    return text


def _popularity(text: str) -> str:
    if text not in POPULARITIES:
        raise ValueError(text)
    return text


def _cell(text: str) -> Cell:
    count, _, budget = text.partition("/")
    return Cell(int(count), _budget(budget))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launch", choices=sorted(COSTS), default="llama3-8b")
    p.add_argument("--counts", type=_list(int), default=[32, 256, 1024], help="adapter counts, comma-separated")
    p.add_argument("--popularities", type=_list(_popularity), default=["uniform", "zipf"], help="uniform, zipf")
    p.add_argument("--budgets", type=_list(_budget), default=list(BUDGETS), help="unlimited, eighth")
    p.add_argument("--cells", type=_list(_cell), default=None,
                   help="COUNT/BUDGET,… to run, in this order, instead of --counts x --budgets (the rest of a split matrix)")
    p.add_argument("--rates", type=_list(float), default=[16.0, 32.0],
                   help="Poisson arrivals per second (run highest first: a cell cut short keeps the targets' rate)")
    p.add_argument("--num-prompts", type=int, default=None, help="requests a run (default: 300 at 8B, 40 otherwise)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up requests before each run (default: 32 at 8B, 4)")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--zipf-alpha", type=float, default=1.0)
    p.add_argument("--rank", type=int, default=16)
    # attn: 1,024 all-projection 8B adapters (84 MB each) fit neither the device's disk nor its memory.
    p.add_argument("--adapter-modules", choices=sorted(MODULE_SETS), default="attn")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--lora-memory-bytes", type=int, default=None, help="passed to every worker when given")
    p.add_argument("--worker-args", default="", help="more flags for every worker (e.g. \"--async-scheduling\")")
    p.add_argument("--borrow-kv-memory", action="store_true",
                   help="every worker's adapter rows borrow idle KV blocks (docs/adapter-memory.md)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-time-limit", type=float, default=None,
                   help="seconds a run may take (default: twice its arrivals at the lowest rate, plus 20)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds for the whole matrix, writing adapters included (default: 480 at 8B, none otherwise)")
    p.add_argument("--adapter-cache", type=Path, default=None,
                   help="adapters written once and kept here (default: a temporary directory, /dev/shm if it has room)")
    p.add_argument("--json", type=Path, default=None, help="every cell and run (rewritten after each cell)")
    p.add_argument("--markdown", type=Path, default=None, help="the table and the targets (rewritten after each cell)")
    p.add_argument("--plan", action="store_true", help="print the estimate and the cells' order, write and run nothing")
    p.add_argument("--report", type=Path, nargs="+", default=None,
                   help="run nothing: the table and the targets of these earlier --json files together")
    args = p.parse_args()
    if args.report:
        return report(args)
    big = args.launch == "llama3-8b"
    args.num_prompts = args.num_prompts or (300 if big else 40)
    args.warmup = args.warmup if args.warmup is not None else (32 if big else 4)
    args.time_limit = args.time_limit if args.time_limit is not None else (480.0 if big else 0.0)
    if min(args.counts) < 1 or min(args.rates) <= 0 or args.num_prompts < 1:
        p.error("--counts and --num-prompts must be >= 1 and --rates > 0")
    if args.cells and min(c.count for c in args.cells) < 1:
        p.error("--cells counts must be >= 1")
    if args.run_time_limit is None:
        args.run_time_limit = 2 * args.num_prompts / min(args.rates) + 20
    args.rates = sorted(args.rates, reverse=True)
    cells = args.cells or cell_order(args.counts, args.budgets)
    args.counts = sorted({c.count for c in cells})  # what the config records: the cells' own
    args.adapter_mb = adapter_bytes(shape_config(args.launch), args.rank, MODULE_SETS[args.adapter_modules]) / 1e6
    if args.plan:
        print_estimate(args, COSTS[args.launch], cells, max(c.count for c in cells))
        print("cells in order: " + ", ".join(f"{c.count} adapters {c.label}" for c in cells))
        return 0
    # A stop from outside (the GPU script's timeout) unwinds like Ctrl-C, through stopped_on_exit:
    # bench/serve.py and its worker are stopped rather than left holding the GPU.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    done = run_matrix(args, cells)
    return 0 if all(c["status"] == "done" for c in done) else 1


if __name__ == "__main__":
    sys.exit(main())
