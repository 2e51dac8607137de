"""Load generator for the serving worker, in the shape of vLLM's `benchmark_serving.py`.

Requests go to `/v1/completions` as streams, each for a random adapter among N (or the base, for
`--base-fraction` of them), with prompt and output lengths drawn uniformly from
`len * [1 - ratio, 1 + ratio]` (vLLM's random dataset; prompts are random token ids, output lengths
are forced with `ignore_eos`). Arrivals are Poisson at `--request-rate` (or all at once with
`inf`), optionally capped at `--max-concurrency` in flight. Reported as vLLM reports them: request
and token throughput; TTFT (to the first token), TPOT (per output token after the first), ITL
(between token-bearing chunks) and end-to-end latency, mean / median / p99, in ms.

Against a running worker:

    python bench/serve.py --base-url http://127.0.0.1:8100 --model BASE --adapters a0 a1 …

or start one (tiny model on CPU; the Llama-3-8B shape with random weights on CUDA):

    python bench/serve.py --launch tiny --num-adapters 8 --num-prompts 200 --request-rate 8
    python bench/serve.py --launch llama3-8b --num-adapters 32 --num-prompts 500 --request-rate 20

Many adapters (issue 21): `--popularity uniform|zipf` picks each request's adapter uniformly or by
Zipf's law over the adapters in order (`a<k>` weighted 1 / (k + 1)^`--zipf-alpha`), seeded; a
comma-separated list, like `--request-rate`'s, runs every popularity at each rate in turn, on one
worker. `--prime` first sends one short request per adapter (their first loads unmeasured). Each
run starts with the worker idle after a warm-up drawn from its own popularity; the worker's
adapter figures (GPU hit rate, adapter loads and bytes moved per second, CPU-cache evictions) are
deltas of its /metrics over the measured window, and what the GPU holds carries over from the run
before. `--run-time-limit` cuts a run that the worker cannot keep up with (its unfinished
requests count as failed). bench/many_adapters.py runs the whole matrix.

    python bench/serve.py --launch tiny --num-adapters 32 --max-loras 4 --popularity uniform,zipf --request-rate 4,8

Through the gateway (issue 22, item 4): `--through-gateway` runs each rate twice, straight to the
launched worker and then requests drawn alike (new prompts, as every window's: none is in the
worker's prefix cache) through `/v1/completions` on
`--web-processes` web processes (default: production's, $WEB_CONCURRENCY else docker-compose.yml's
default, 4) as a tenant whose quotas never bind, and prints both side by side with the gateway's
added TTFT p50 and its share of direct's output tok/s (bench/serve_gateway.py says how the platform is set up).

    python bench/serve.py --launch tiny --num-adapters 4 --num-prompts 40 --request-rate 4,8 --through-gateway

Past ~80 req/s one event loop reading every chunk is itself the bottleneck: `--load-processes K`
sends each run's measured requests from K spawned processes at the same Poisson times
(bench/serve_load_processes.py). A rate's figures hold only once its queue has had time to build:
200 requests at 128 req/s last 3 s, so sustained curves use 1,000 (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import platform
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder heads sys.path; the repository root must be there instead.
sys.path[0] = str(ROOT)

from bench.random_adapters import MODULE_SETS  # noqa: E402
from bench.card import card  # noqa: E402
from bench.serve_gateway import (Gateway, compare, gateway_platform, print_comparisons,  # noqa: E402
                                 production_web_processes, started_gateway, worker_flags)
from bench.serve_launch import launched_worker  # noqa: E402
from bench.serve_report import print_runs, print_summary  # noqa: E402
from bench.serve_load_processes import LoadProcesses  # noqa: E402
from bench.serve_request import Result, one_request  # noqa: E402
from bench.serve_profile import sampled  # noqa: E402
from bench.worker_metrics import scrape_metrics, total, window_metrics  # noqa: E402

# Token ids below this are special tokens in the tiny tokenizer; prompts avoid them.
_FIRST_PLAIN_ID = 16
POPULARITIES = ("uniform", "zipf")
# How long a run waits for the worker to finish the previous run's requests before its window.
_SETTLE_TIMEOUT_S = 60.0


def adapter_picker(adapters: list[str], popularity: str, alpha: float) -> Callable[[random.Random], str]:
    """How a request picks its adapter: uniformly, or by Zipf's law over ``adapters`` in their order
    (the k-th, from 0, weighted 1 / (k + 1)^alpha: the first the most wanted)."""
    if popularity == "uniform":
        return lambda rng: rng.choice(adapters)
    if popularity != "zipf" or alpha <= 0:
        raise ValueError(f"popularity must be uniform or zipf with alpha > 0, got {popularity!r}, alpha {alpha}")
    cumulative = list(itertools.accumulate(1 / (k + 1) ** alpha for k in range(len(adapters))))
    return lambda rng: rng.choices(adapters, cum_weights=cumulative)[0]


# Numbers this process's measured windows, for their prompts' seeds (run_load).
_WINDOWS = itertools.count()


def _requests(args: argparse.Namespace, rng: random.Random, count: int, input_len: int, output_len: int,
              pick: Callable[[random.Random], str] | None) -> list[tuple[str, list[int], int]]:
    """``count`` (model, prompt ids, output length) triples, lengths drawn around the given means."""

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - args.random_range_ratio)), int(mean * (1 + args.random_range_ratio))))

    requests = []
    for _ in range(count):
        prompt = [rng.randrange(_FIRST_PLAIN_ID, args.vocab_size) for _ in range(length(input_len))]
        model = args.model if pick is None or rng.random() < args.base_fraction else pick(rng)
        requests.append((model, prompt, length(output_len)))
    return requests


async def run_load(args: argparse.Namespace, popularity: str = "uniform", gateway: Gateway | None = None,
                   path: str = "direct", loaders: LoadProcesses | None = None) -> tuple[list[Result], float, dict[str, Any]]:
    """One run: its warm-up, then the measured window, sent along ``path``: straight to the worker,
    or through ``gateway``'s web processes in turn, from this process or from ``loaders``. Returns
    the window's results, its duration and what the worker's /metrics say about it
    (``window_metrics``: ``metrics`` false where it could not be read), with how many requests the
    time limit cut or left unsent."""
    pick = adapter_picker(args.adapters, popularity, args.zipf_alpha) if args.adapters else None
    # The requests, then the gaps between their arrivals. Each window of this process draws prompts of
    # its own (the window's number in the seed): with the same prompts again, the worker's prefix
    # cache held every later window's prompts (prefix caching is on by default), so every rate after
    # the first (and the gateway's half of --through-gateway) skipped its prefills.
    rng = random.Random(f"{args.seed}-window{next(_WINDOWS)}")
    requests = _requests(args, rng, args.num_prompts, args.random_input_len, args.random_output_len, pick)
    # The warm-up's adapters are drawn apart from the window's (their own stream): drawn from the
    # window's first requests, they would make those requests GPU hits by construction.
    warmup = _requests(args, random.Random(f"{args.seed}-warmup"), args.warmup, 32, 4, pick)
    # A fresh connection per request, as vLLM's benchmark_serving has (a session per request): a
    # kept-alive one races the worker's keep-alive timeout (uvicorn's 5 s). At 256 streams on a
    # few cores this process's event loop lags seconds between taking an idle connection from the
    # pool and writing on it, so the worker had closed it meanwhile and about one request in 1,000
    # failed with ReadError('') before any response (docs/benchmarks.md).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    via = gateway if path == "gateway" else None
    urls = [f"{url}/v1/completions" for url in via.urls] if via else ["/v1/completions"]
    fields = gateway.upstream if gateway is not None and via is None else {}
    tenant = {"Authorization": f"Bearer {via.key}"} if via else {}
    # The worker's client also reads its /metrics; the gateway's client sends as the tenant.
    async with (httpx.AsyncClient(base_url=args.base_url, timeout=None, limits=limits, headers=_auth(args)) as worker,
                httpx.AsyncClient(timeout=None, limits=limits, headers=tenant) if via
                else contextlib.nullcontext(worker) as client):

        async def send(index: int, model: str, prompt: list[int], output_len: int,
                       run_start: float | None = None) -> Result:
            return await one_request(client, model, prompt, output_len, run_start, url=urls[index % len(urls)],
                                     fields=fields.get(model))

        # Warm-up (kernel compilation, first slot loads) is not measured. With load processes it is
        # sent from them: each spawned process's first requests (httpx's async transport imported and
        # set up there) would otherwise fall in the first window.
        if loaders is not None:
            await loaders.run(warmup, [0.0] * len(warmup), base_url=None if via else args.base_url,
                              headers=tenant if via else _auth(args), urls=urls, fields=fields, time_limit=None)
        else:
            await asyncio.gather(*(send(i, m, p, n) for i, (m, p, n) in enumerate(warmup)))
        settled = await _settle(worker)
        before = await scrape_metrics(worker)
        if loaders is not None:
            # The arrival times the single loop below would draw, from the same seeded stream.
            offsets = list(itertools.accumulate((rng.expovariate(args.request_rate) for _ in requests[1:]), initial=0.0)) \
                if args.request_rate != float("inf") else [0.0] * len(requests)
            sent, duration, _ = await loaders.run(
                requests, offsets, base_url=None if via else args.base_url, headers=tenant if via else _auth(args),
                urls=urls, fields=fields, time_limit=args.run_time_limit)
            after = await scrape_metrics(worker)
            unsent = Result(ok=False, error=f"cut or not sent at the run's time limit ({args.run_time_limit}s)")
            window = window_metrics(before, after, duration)
            window.update(settled_before=settled, cut=sum(r is None for r in sent), load_processes=loaders.processes)
            return [r if r is not None else unsent for r in sent], duration, window
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()

        async def limited(index: int, model: str, prompt: list[int], output_len: int) -> Result:
            async with gate:
                return await send(index, model, prompt, output_len, start)

        tasks = []
        start = time.perf_counter()
        deadline = start + (args.run_time_limit or float("inf"))
        for index, (model, prompt, output_len) in enumerate(requests):
            if time.perf_counter() >= deadline:
                break
            tasks.append(asyncio.create_task(limited(index, model, prompt, output_len)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        left = None if args.run_time_limit is None else max(0.0, deadline - time.perf_counter())
        done, pending = await asyncio.wait(tasks, timeout=left) if tasks else (set(), set())
        duration = time.perf_counter() - start
        after = await scrape_metrics(worker)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    # Only a time limit leaves tasks pending or requests unsent.
    cut = Result(ok=False, error=f"cut at the run's time limit ({args.run_time_limit}s)")
    results = [task.result() if task in done else cut for task in tasks]
    results += [Result(ok=False, error=f"not sent: the run's time limit ({args.run_time_limit}s) came first")
                for _ in requests[len(tasks):]]
    window = window_metrics(before, after, duration)
    window["settled_before"] = settled
    window["cut"] = len(pending) + len(requests) - len(tasks)
    return results, duration, window


async def _settle(client: httpx.AsyncClient) -> bool:
    """Waits until the worker runs and queues nothing (the previous run's tail, the warm-up);
    whether it got there. True at once when /metrics cannot be read."""
    deadline = time.monotonic() + _SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        samples = await scrape_metrics(client)
        if samples is None:
            return True
        busy = [total(samples, name) for name in ("loraplex_num_requests_running", "loraplex_num_requests_waiting")]
        if not any(busy):
            return True
        await asyncio.sleep(0.25)
    return False


async def prime(args: argparse.Namespace, fields: dict[str, dict[str, Any]]) -> tuple[float, int]:
    """One short request per adapter, a0 first, 64 in flight at a time, so that a worker's first run
    does not pay every adapter's first load: with room for all, all are resident after it, else the
    last ones primed. ``fields``: per adapter, what its body adds (a registry version's, under
    --through-gateway). The seconds it took and how many of its requests failed."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    gate = asyncio.Semaphore(64)
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=args.base_url, timeout=None, limits=limits, headers=_auth(args)) as client:

        async def one(adapter: str) -> Result:
            async with gate:
                return await one_request(client, adapter, [_FIRST_PLAIN_ID] * 4, 1, fields=fields.get(adapter))

        results = await asyncio.gather(*(one(adapter) for adapter in args.adapters))
    return time.perf_counter() - start, sum(not r.ok for r in results)


def _auth(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def summarize(results: list[Result], duration: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_token_throughput": output / duration,
        "total_token_throughput": (output + prompt) / duration,
        "total_output_tokens": output,
        "total_input_tokens": prompt,
    }
    series = {
        "ttft": [r.ttft for r in done],
        "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.e2e for r in done],
    }
    for name, values in series.items():
        if values:
            ordered = sorted(values)
            summary[f"mean_{name}_ms"] = statistics.fmean(values) * 1000
            summary[f"median_{name}_ms"] = statistics.median(values) * 1000
            summary[f"p99_{name}_ms"] = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000
    return summary


def _comma_list(text: str, kind: Callable[[str], Any], what: str, p: argparse.ArgumentParser) -> list[Any]:
    try:
        return [kind(item) for item in text.split(",")]
    except ValueError:
        p.error(f"{what}, comma-separated; got {text!r}")


def _popularity(text: str) -> str:
    if text not in POPULARITIES:
        raise ValueError(text)
    return text


def _write_record(args: argparse.Namespace, summaries: list[dict[str, Any]], launch: dict[str, Any],
                  comparisons: list[dict[str, Any]]) -> None:
    record = {"args": {k: v for k, v in vars(args).items() if k not in ("api_key", "json")},
              "host": platform.node(), "python": platform.python_version(), "card": card(), "launch": launch,
              **({"gateway": comparisons} if args.through_gateway else {}),
              **(summaries[0] if len(summaries) == 1 else {"runs": summaries})}
    args.json.write_text(json.dumps(record, indent=2, default=str))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8100")
    p.add_argument("--model", default="base", help="the base model's served name")
    p.add_argument("--adapters", nargs="*", default=[], help="adapter names to spread requests over")
    p.add_argument("--api-key", default=None)
    p.add_argument("--base-fraction", type=float, default=0.0, help="share of requests for the base model")
    p.add_argument(
        "--popularity", default="uniform",
        help="how a request picks its adapter: uniform, or zipf (the k-th adapter weighted 1/(k+1)^alpha); "
        "a comma-separated list runs each in turn at every --request-rate on the same worker",
    )  # fmt: skip
    p.add_argument("--zipf-alpha", type=float, default=1.0, help="Zipf's exponent (> 0)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument(
        "--request-rate", default="inf",
        help="Poisson arrivals per second; a comma-separated list runs each rate in turn on the same worker (a curve)",
    )  # fmt: skip
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--load-processes", type=int, default=1,
                   help="send each run's measured requests from this many processes (one event loop reads "
                   "~10,000 chunks/s; bench/serve_load_processes.py)")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.25)
    p.add_argument("--vocab-size", type=int, default=256, help="prompt token ids are drawn below this")
    p.add_argument("--warmup", type=int, default=8, help="short requests before each run, not measured")
    p.add_argument("--prime", action="store_true",
                   help="before the first run, one short request per adapter (each adapter's first load unmeasured)")
    p.add_argument("--run-time-limit", type=float, default=None,
                   help="seconds: a run's window stops here; requests unfinished or unsent by then count as failed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the summary here (rewritten after each run)")
    launch = p.add_argument_group("launching a worker (--launch)")
    launch.add_argument("--launch", choices=["tiny", "small", "llama3-8b"], default=None)
    launch.add_argument("--num-adapters", type=int, default=8)
    launch.add_argument("--rank", type=int, default=16)
    launch.add_argument("--adapter-modules", choices=sorted(MODULE_SETS), default="all",
                        help="projections the adapters adapt: all seven, or attn (q, k, v, o)")
    launch.add_argument("--adapter-cache", type=Path, default=None,
                        help="keep the adapters here across runs (by shape, rank and modules; adapter a<i> has seed i)")
    launch.add_argument("--max-loras", type=int, default=None,
                        help="the worker's GPU adapter bound (default: --num-adapters; 0: the worker's own default)")
    launch.add_argument("--lora-memory-bytes", type=int, default=None,
                        help="the worker's GPU adapter memory budget (passed only when given)")
    launch.add_argument("--awq-base", action="store_true",
                        help="serve the shape as a random AWQ INT4 checkpoint (bench/awq_checkpoint.py), not dummy "
                             "bf16 weights (--worker-args=\"--quantization fp8\" gives the FP8 base)")
    launch.add_argument("--max-num-seqs", type=int, default=256)
    # The worker's own default: a larger budget lets a burst of prompts make steps over the
    # captured ladder (max_flat_tokens, 2048), which run eagerly and stall every decode meanwhile.
    launch.add_argument("--max-num-batched-tokens", type=int, default=2048)
    launch.add_argument("--worker-args", default="",
                        help="more flags for the launched worker, one string (e.g. \"--async-scheduling\")")
    gateway_args = p.add_argument_group("through the gateway (--through-gateway)")
    gateway_args.add_argument("--through-gateway", action="store_true",
                              help="each run also through /v1 on the web processes, as a tenant (needs --launch; primes)")
    gateway_args.add_argument("--web-processes", type=int, default=None,
                              help="web processes (default: production's: $WEB_CONCURRENCY, else docker-compose.yml's, 4)")
    p.add_argument("--py-spy-dir", type=Path, default=None,
                   help="sample the worker (--launch), this load generator and, through the gateway, the web "
                   "processes with py-spy during the last run")
    args = p.parse_args()
    if args.py_spy_dir is not None and not args.launch:
        p.error("--py-spy-dir samples a launched worker: it needs --launch")
    rates = _comma_list(args.request_rate, float, "--request-rate takes numbers (or inf)", p)
    popularities = _comma_list(args.popularity, _popularity, f"--popularity takes {' or '.join(POPULARITIES)}", p)
    if args.zipf_alpha <= 0:
        p.error(f"--zipf-alpha must be > 0, got {args.zipf_alpha}")
    if args.load_processes < 1:
        p.error(f"--load-processes must be >= 1, got {args.load_processes}")
    if args.load_processes > 1 and args.max_concurrency:
        p.error("--max-concurrency caps one event loop's requests in flight: it cannot be split over --load-processes")
    if args.run_time_limit is not None and args.run_time_limit <= 0:
        p.error(f"--run-time-limit must be > 0 seconds, got {args.run_time_limit}")
    if args.num_adapters < 0 or (args.max_loras or 0) < 0:
        p.error("--num-adapters and --max-loras must be >= 0")
    if args.lora_memory_bytes is not None and args.lora_memory_bytes <= 0:
        p.error(f"--lora-memory-bytes must be > 0, got {args.lora_memory_bytes}")
    if args.max_loras is None:
        args.max_loras = args.num_adapters
    if args.through_gateway and not (args.launch and args.num_adapters):
        p.error("--through-gateway registers the launched worker's adapters: it needs --launch and --num-adapters >= 1")
    if args.web_processes is None:
        args.web_processes = production_web_processes()
    if args.web_processes < 1:
        p.error(f"--web-processes must be >= 1, got {args.web_processes}")
    # Straight to the worker, the registry's versions load on their first request: primed, neither
    # path's first run pays for them.
    args.prime = args.prime or args.through_gateway
    # A stop from outside (the GPU script's timeout) unwinds like Ctrl-C: the launched worker is
    # stopped on the way out rather than left holding the GPU.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    # Rates in the order given, each with every popularity: a run cut short of its rates keeps every
    # popularity's figures at the rates it reached (bench/many_adapters.py gives the highest first).
    # Under --through-gateway each run is followed by the same requests through the gateway.
    paths = ("direct", "gateway") if args.through_gateway else ("direct",)
    runs = [(popularity, rate, path) for rate in rates for popularity in popularities for path in paths]
    summaries: list[dict[str, Any]] = []
    comparisons: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        var_dir = stack.enter_context(gateway_platform(args)) if args.through_gateway else None
        flags = worker_flags() if args.through_gateway else []
        worker = stack.enter_context(launched_worker(args, worker_flags=flags, preload=not args.through_gateway)) \
            if args.launch else None
        gateway = stack.enter_context(started_gateway(args, worker, var_dir)) if worker and var_dir else None
        launch_info = worker.info if worker else {}
        loaders = None
        if args.load_processes > 1:
            loaders = LoadProcesses(args.load_processes)
            stack.callback(loaders.close)
        if args.prime and args.adapters:
            upstream = gateway.upstream if gateway else {}
            launch_info["prime_s"], launch_info["prime_failed"] = asyncio.run(prime(args, upstream))
            print(f"primed {len(args.adapters)} adapters in {launch_info['prime_s']:.1f}s "
                  f"({launch_info['prime_failed']} failed)", flush=True)
        if len(runs) > 1:
            print("runs share one worker: each starts with the worker idle after its own warm-up, its worker "
                  "figures are /metrics deltas over its window, and the GPU's adapters carry over from the run before",
                  flush=True)
        for i, (popularity, rate, path) in enumerate(runs):
            args.request_rate = rate
            profiled = args.py_spy_dir is not None and i == len(runs) - 1
            spied = {"worker": worker.process if worker else None, "client": None}
            if gateway and path == "gateway":
                spied.update(gateway.processes)
            with sampled(args.py_spy_dir, spied, rate) if profiled else contextlib.nullcontext():
                results, duration, window = asyncio.run(run_load(args, popularity, gateway, path, loaders))
            summary = {"popularity": popularity, "request_rate": rate, **summarize(results, duration), "worker": window}
            print(f"{popularity} popularity, request rate {rate} req/s" + (f", {path}" if gateway else ""))
            print_summary(summary, args)
            for error in sorted({r.error for r in results if not r.ok})[:5]:
                print(f"error: {error}")
            if gateway:
                summary["path"] = path
                if path == "gateway":
                    comparisons.append(compare(summaries[-1], summary))
            summaries.append(summary)
            if args.json:
                _write_record(args, summaries, launch_info, comparisons)
    if len(summaries) > 1:
        print_runs(summaries)
    if comparisons:
        print_comparisons(comparisons, args.web_processes)
    return 0 if all(s["completed"] for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
