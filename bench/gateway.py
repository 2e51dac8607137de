"""What the gateway adds: the same streamed requests through `/v1` on the web process and straight
to the serving worker, in one run, alternating, so both see the same machine.

Starts its own platform on the embedded defaults in a temporary directory (SQLite, embedded
Redis, the tiny model on CPU): one serving worker, one web process under uvicorn, a tenant on a
tier whose limits never bind. Then:

1. closed loop at each `--concurrency` (1, 16, 64 by default): rounds of C concurrent streamed
   completions, one round direct, one round through the gateway, `--rounds` times; the added
   TTFT (to the first content chunk) and end-to-end latency, p50 and p99;
2. open loop (Poisson arrivals) at increasing `--rates`, direct and through the gateway in
   alternating one-second slices; the highest rate whose added p50 stays within 2 ms;
3. the gateway's cost per request: `--cost-requests` streamed completions through the gateway
   alone, `--cost-concurrency` at a time, and the web process's CPU time (user + system, from
   /proc) and Redis's commands (INFO commandstats) over them, per request; on the base model, and
   with `--adapters N` also cycling over N registered adapters of one tenant (tiny rank-8 ones,
   bench/fleet_platform.py's), which adds the version's breaker and prewarm counts to the path;
   with `--cost-tokens A B`, the base model's cost phase runs at A and at B tokens per reply, and
   the difference gives the web process's CPU per relayed token and per request (the intercept).

    python bench/gateway.py [--rounds 30] [--concurrency 1 16 64] [--max-tokens 8]
        [--rates 25 50 100 200 400] [--cost-requests 300] [--cost-concurrency 4] [--adapters 8]
        [--cost-tokens 8 64]
        [--profile out.prof]
        [--json out.json]

`--profile` runs the web process under cProfile and writes its profile at exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

ROOT = Path(__file__).resolve().parents[1]
WORKER_KEY = "bench-worker-key"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Sample:
    ttft: float
    e2e: float


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def embedded_platform(var_dir: Path, redis_url: str | None = None) -> Path:
    """This process set up as the platform on its embedded defaults in `var_dir` (SQLite, local
    storage, the embedded Redis, whose URL the settings export to the children, or `redis_url`'s),
    migrated, with the tiny model built as the base; the model's directory. Children started after
    this inherit it all."""
    os.environ.update(LORAPLEX_VAR_DIR=str(var_dir), DJANGO_SETTINGS_MODULE="lora_platform.settings",
                      SERVING_WORKER_API_KEY=WORKER_KEY, DJANGO_DEBUG="0", LOG_LEVEL="WARNING",
                      # Production's mode needs a key of its own (docs/operations.md, "Settings").
                      DJANGO_SECRET_KEY="bench-gateway-secret-key")
    for name in ("REDIS_URL", "DATABASE_URL", "STORAGE_URL"):
        os.environ.pop(name, None)
    if redis_url:
        os.environ["REDIS_URL"] = redis_url
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command

    from serving.engine.tiny import build_tiny_model

    call_command("migrate", interactive=False, verbosity=0)
    model = build_tiny_model(var_dir / "models" / "tiny-llama", arch="llama", seed=0)
    os.environ.update(BASE_MODEL_PATH=str(model), BASE_MODEL_NAME="tiny-llama")
    settings.BASE_MODEL_NAME = "tiny-llama"
    return model


def bench_tenant(slug: str, *, max_adapters: int = 1) -> tuple[Any, str]:
    """A tenant (and its API key) on the `bench` tier, whose rate limits never bind."""
    from tenants.models import Tier
    from tenants.services import tenant_create

    Tier.objects.update_or_create(name="bench", defaults=dict(
        requests_per_minute=10_000_000, tokens_per_minute=1_000_000_000, max_tokens_per_request=512,
        priority=0, max_concurrent_training_jobs=1, max_adapters=max_adapters, degradation_allowed=False))
    return tenant_create(slug=slug, tier_name="bench")


def wait_up(url: str, log: Path, timeout_s: float = 300.0) -> None:
    """Until `url` answers 200; exits naming the log to read if it never does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} did not come up; see {log}")


class Platform:
    """The worker and the web process, on a fresh temporary var dir."""

    def __init__(self, var_dir: Path, profile: str | None, adapters: int = 0) -> None:
        self.var_dir = var_dir
        from django.conf import settings

        model = embedded_platform(var_dir)  # puts the repository on sys.path
        from bench.fleet_platform import Served, adapter_files, register

        _, self.key = bench_tenant(f"bench-{int(time.time())}")
        self.adapters: list[Served] = (register(adapter_files(model, adapters, var_dir), 1, f"{int(time.time())}")
                                       if adapters else [])
        storage = Path(settings.STORAGE_URL.removeprefix("file://"))
        self.worker_port, self.web_port = free_port(), free_port()
        self.worker_url = f"http://127.0.0.1:{self.worker_port}"
        self.web_url = f"http://127.0.0.1:{self.web_port}"
        logs = open(var_dir / "processes.log", "wb")
        self.children = [
            subprocess.Popen([sys.executable, "-m", "serving.engine.server", "--model", str(model), "--port",
                              str(self.worker_port), "--served-model-name", "tiny-llama", "--api-key", WORKER_KEY,
                              "--redis-url", settings.REDIS_URL, "--worker-id", "bench-worker",
                              "--heartbeat-interval", "1", "--allowed-adapter-path", str(storage),
                              "--uvicorn-log-level", "warning"],
                             cwd=ROOT, stdout=logs, stderr=subprocess.STDOUT),
            subprocess.Popen([sys.executable, *(["-m", "cProfile", "-o", profile] if profile else []), "-m", "uvicorn",
                              "lora_platform.asgi:application", "--port", str(self.web_port), "--log-level", "warning"],
                             cwd=ROOT, stdout=logs, stderr=subprocess.STDOUT),
        ]
        wait_up(f"{self.worker_url}/health", var_dir / "processes.log")
        wait_up(f"{self.web_url}/metrics", var_dir / "processes.log")

    @property
    def web_pid(self) -> int:
        return self.children[1].pid

    def stop(self) -> None:
        for child in self.children:
            child.terminate()
        for child in self.children:
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()


ERRORS: dict[str, list[str]] = {}


async def one(client: httpx.AsyncClient, url: str, key: str, max_tokens: int,
              model: str = "tiny-llama") -> Sample | None:
    """One streamed request; None (and the error kept in ERRORS) when it fails."""
    try:
        return await _one(client, url, key, max_tokens, model)
    except httpx.HTTPError as exc:
        ERRORS.setdefault(url, []).append(repr(exc))
        return None


async def _one(client: httpx.AsyncClient, url: str, key: str, max_tokens: int, model: str) -> Sample:
    body = {"model": model, "prompt": "The gateway adds", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", f"{url}/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as response:
        if response.status_code != 200:
            raise SystemExit(f"{url}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = time.perf_counter() - start
    return Sample(ttft=ttft or float("nan"), e2e=time.perf_counter() - start)


async def closed_loop(p: Platform, concurrency: int, rounds: int, max_tokens: int) -> dict[str, list[Sample]]:
    samples: dict[str, list[Sample]] = {"direct": [], "gateway": []}
    targets = {"direct": (p.worker_url, WORKER_KEY), "gateway": (p.web_url, p.key)}
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        for name, (url, key) in targets.items():  # warm-up: connections, caches
            await asyncio.gather(*(one(client, url, key, max_tokens) for _ in range(concurrency)))
        for index in range(rounds * 2):
            name = ("direct", "gateway")[index % 2]
            url, key = targets[name]
            done = await asyncio.gather(*(one(client, url, key, max_tokens) for _ in range(concurrency)))
            samples[name] += [sample for sample in done if sample is not None]
    return samples


async def open_loop(p: Platform, rate: float, seconds: float, max_tokens: int) -> dict[str, list[float]]:
    e2e: dict[str, list[float]] = {"direct": [], "gateway": []}
    targets = {"direct": (p.worker_url, WORKER_KEY), "gateway": (p.web_url, p.key)}
    rng = random.Random(0)
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=2000)) as client:
        tasks = []
        start = time.perf_counter()
        next_at = start
        while next_at - start < seconds:
            slice_index = int(next_at - start)
            name = ("direct", "gateway")[slice_index % 2]
            url, key = targets[name]
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))

            async def timed(name: str = name, url: str = url, key: str = key) -> None:
                sample = await one(client, url, key, max_tokens)
                if sample is not None:
                    e2e[name].append(sample.e2e)

            tasks.append(asyncio.ensure_future(timed()))
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return e2e


def redis_commands(url: str) -> dict[str, int]:
    """Redis's count of calls per command since it started (INFO commandstats)."""
    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


async def cost(p: Platform, requests: int, concurrency: int, max_tokens: int, redis_url: str,
               models: list[tuple[str, str]]) -> dict[str, Any]:
    """The web process's CPU ms and Redis's commands per request through the gateway, over
    `requests` streamed completions sent `concurrency` at a time, cycling over `models` ((model,
    key) pairs), after a warm-up that names each at least twice."""
    process = psutil.Process(p.web_pid)
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def run(count: int) -> list[Sample]:
            queue = iter(range(count))
            done: list[Sample] = []

            async def lane() -> None:
                for index in queue:
                    model, key = models[index % len(models)]
                    sample = await one(client, p.web_url, key, max_tokens, model)
                    if sample is not None:
                        done.append(sample)

            await asyncio.gather(*(lane() for _ in range(concurrency)))
            return done

        await run(max(concurrency, 20, 2 * len(models)))
        commands_before, cpu_before = redis_commands(redis_url), process.cpu_times()
        started = time.perf_counter()
        samples = await run(requests)
        wall = time.perf_counter() - started
        cpu_after, commands_after = process.cpu_times(), redis_commands(redis_url)
    cpu_s = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
    # The INFO calls themselves are not the gateway's.
    commands = {name: (calls - commands_before.get(name, 0)) / requests for name, calls in commands_after.items()
                if calls - commands_before.get(name, 0) - (1 if name == "info" else 0) > 0}
    commands.pop("info", None)
    ttft = [sample.ttft for sample in samples]
    return {"models": len(models), "requests": requests, "concurrency": concurrency, "completed": len(samples),
            "wall_s": wall,
            "cpu_ms_per_request": cpu_s * 1000 / requests,
            "user_ms_per_request": (cpu_after.user - cpu_before.user) * 1000 / requests,
            "system_ms_per_request": (cpu_after.system - cpu_before.system) * 1000 / requests,
            "redis_commands_per_request": round(sum(commands.values()), 2),
            "redis_commands": {name: round(value, 2) for name, value in sorted(commands.items())},
            "ttft_p50_ms": percentile(ttft, 50) * 1000, "ttft_p99_ms": percentile(ttft, 99) * 1000}


def ms(value: float) -> str:
    return f"{value * 1000:8.2f}"


def per_token(p: Platform, args: argparse.Namespace) -> dict[str, float]:
    """The base model's cost phase at `--cost-tokens` A and B tokens per reply: the web process's
    CPU per relayed token (the slope) and per request (the intercept at 0 tokens)."""
    from django.conf import settings

    short, long = args.cost_tokens
    cpu = {tokens: asyncio.run(cost(p, args.cost_requests, args.cost_concurrency, tokens, settings.REDIS_URL,
                                    [("tiny-llama", p.key)]))["cpu_ms_per_request"] for tokens in (short, long)}
    slope = (cpu[long] - cpu[short]) / (long - short)
    figures = {"tokens": [short, long], "cpu_ms_per_request": [cpu[short], cpu[long]],
               "cpu_ms_per_token": slope, "cpu_ms_per_request_at_0_tokens": cpu[short] - slope * short}
    print(f"\nweb process CPU per request, base model, {short} / {long} tokens a reply: {cpu[short]:.2f} / "
          f"{cpu[long]:.2f} ms; per relayed token {slope:.4f} ms, per request (0 tokens) "
          f"{figures['cpu_ms_per_request_at_0_tokens']:.2f} ms")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rates", type=float, nargs="*", default=[25, 50, 100, 200, 400])
    parser.add_argument("--seconds", type=float, default=10.0, help="per rate, half of it each way")
    parser.add_argument("--cost-requests", type=int, default=300, help="0: no cost phase")
    parser.add_argument("--cost-concurrency", type=int, default=4)
    parser.add_argument("--cost-tokens", type=int, nargs=2, default=None, metavar=("A", "B"),
                        help="also measure the base model's cost at A and B tokens per reply: CPU per relayed token")
    parser.add_argument("--adapters", type=int, default=0,
                        help="also measure the cost over this many registered adapters (0: the base model only)")
    parser.add_argument("--profile", default=None)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    report: dict[str, Any] = {"args": vars(args), "host": platform.node(), "cpus": os.cpu_count(),
                              "python": platform.python_version(), "load_average": os.getloadavg(),
                              "closed_loop": [], "open_loop": []}

    print(f"# bench/gateway.py {' '.join(sys.argv[1:])}")
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        p = Platform(Path(tmp), args.profile, args.adapters)
        try:
            print(f"\nclosed loop, streamed /v1/completions, {args.max_tokens} tokens, {args.rounds} rounds each way")
            print("concurrency | direct TTFT p50  p99 | gateway TTFT p50  p99 | added TTFT p50  p99 | "
                  "added e2e p50  p99 (ms)")
            for concurrency in args.concurrency:
                s = asyncio.run(closed_loop(p, concurrency, args.rounds, args.max_tokens))
                d_ttft, g_ttft = [x.ttft for x in s["direct"]], [x.ttft for x in s["gateway"]]
                d_e2e, g_e2e = [x.e2e for x in s["direct"]], [x.e2e for x in s["gateway"]]
                print(f"{concurrency:11d} | {ms(percentile(d_ttft, 50))} {ms(percentile(d_ttft, 99))} | "
                      f"{ms(percentile(g_ttft, 50))} {ms(percentile(g_ttft, 99))} | "
                      f"{ms(percentile(g_ttft, 50) - percentile(d_ttft, 50))} "
                      f"{ms(percentile(g_ttft, 99) - percentile(d_ttft, 99))} | "
                      f"{ms(percentile(g_e2e, 50) - percentile(d_e2e, 50))} "
                      f"{ms(percentile(g_e2e, 99) - percentile(d_e2e, 99))}")
                report["closed_loop"].append({
                    "concurrency": concurrency,
                    **{f"{path}_ttft_{q}_ms": percentile(values, q) * 1000
                       for path, values in (("direct", d_ttft), ("gateway", g_ttft)) for q in (50, 99)},
                    "added_ttft_p50_ms": (percentile(g_ttft, 50) - percentile(d_ttft, 50)) * 1000,
                    "added_ttft_p99_ms": (percentile(g_ttft, 99) - percentile(d_ttft, 99)) * 1000,
                    "added_e2e_p50_ms": (percentile(g_e2e, 50) - percentile(d_e2e, 50)) * 1000})
            if args.rates:
                print(f"\nopen loop (Poisson), {args.seconds:.0f} s per rate, alternating 1 s slices")
                print("rate req/s | direct e2e p50 | gateway e2e p50 | added p50 (ms) | completed/s")
                sustained = None
                for rate in args.rates:
                    e2e = asyncio.run(open_loop(p, rate, args.seconds, args.max_tokens))
                    added = statistics.median(e2e["gateway"]) - statistics.median(e2e["direct"])
                    done = (len(e2e["direct"]) + len(e2e["gateway"])) / args.seconds
                    print(f"{rate:10.0f} | {ms(statistics.median(e2e['direct']))} | "
                          f"{ms(statistics.median(e2e['gateway']))} | {ms(added)} | {done:8.1f}")
                    if added <= 0.002:
                        sustained = rate
                    report["open_loop"].append({"rate": rate, "added_e2e_p50_ms": added * 1000,
                                                "completed_per_s": done})
                print(f"\nhighest rate with added p50 <= 2 ms: {sustained if sustained is not None else 'none measured'}")
            if args.cost_requests:
                from django.conf import settings

                report["cost"] = []
                kinds = [("base model", [("tiny-llama", p.key)])]
                if p.adapters:
                    kinds.append((f"{len(p.adapters)} adapters", [(a.model, a.key) for a in p.adapters]))
                for kind, models in kinds:
                    figures = asyncio.run(cost(p, args.cost_requests, args.cost_concurrency, args.max_tokens,
                                               settings.REDIS_URL, models))
                    report["cost"].append({"kind": kind, **figures})
                    print(f"\ngateway cost, {kind}: {args.cost_requests} streamed requests through the gateway, "
                          f"{args.cost_concurrency} at a time ({figures['completed']} completed in "
                          f"{figures['wall_s']:.1f} s)")
                    print(f"web process CPU per request: {figures['cpu_ms_per_request']:.2f} ms (user "
                          f"{figures['user_ms_per_request']:.2f}, system {figures['system_ms_per_request']:.2f}); "
                          f"gateway TTFT p50 / p99 {figures['ttft_p50_ms']:.1f} / {figures['ttft_p99_ms']:.1f} ms")
                    print(f"Redis commands per request: {figures['redis_commands_per_request']:.2f} "
                          f"({', '.join(f'{name} {value}' for name, value in figures['redis_commands'].items())})")
            if args.cost_requests and args.cost_tokens:
                report["per_token"] = per_token(p, args)
            report["load_average_end"] = os.getloadavg()
            if args.json:
                Path(args.json).write_text(json.dumps(report, indent=2))
            for url, errors in ERRORS.items():
                print(f"failed requests to {url}: {len(errors)} ({errors[0]})")
        except BaseException:
            print(f"\nprocess log (tail):\n{(Path(tmp) / 'processes.log').read_text(errors='replace')[-4000:]}")
            raise
        finally:
            p.stop()


if __name__ == "__main__":
    main()
