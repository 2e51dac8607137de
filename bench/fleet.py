"""A fleet: K serving workers behind W web processes, one multi-tenant trace replayed once per
routing policy (GATEWAY_ROUTING: affinity, then round_robin), each on fresh processes.

The platform: bench/gateway.py's embedded one (SQLite, embedded Redis, local storage, the tiny
model on CPU), with `--adapters` tiny rank-8 adapters registered and deployed as versions of
`--tenants` tenants (bench/fleet_platform.py). Per policy: Redis emptied (breakers, buckets, the
registry), K workers (`--slots` GPU slots over a CPU cache of `--cpu-cache` each, registering
themselves in Redis) and W web processes started with that policy; the client sends to the web
processes in turn, as a load balancer would, so `/v1` on each routes across the workers.

The trace: bench/prewarm.py's day (Zipf popularity over the adapters, `--zipf`, each adapter's
traffic peaking at its own hour, so the popular set shifts), `--requests` arrivals compressed into
`--day-seconds` of wall time; each request a streamed completion of `--max-tokens` tokens for its
adapter with its tenant's key, bounded by `--timeout` seconds (nothing hangs).

`--kill-worker-at SECONDS` SIGKILLs the first worker that far into each replay: requests before
their first byte fail over (serving.gateway.failover), streams under way on it break. The report
counts failed requests by kind, and times from the kill to the worker leaving the registry's live
list (its TTL: three 1 s heartbeats) and to the gateway's last failover retry (its last attempt
on the dead worker; outlier ejection may end them before the TTL does).

Figures per policy: throughput, TTFT p50/p99 (client: sent → first token event), per worker its
share of requests and distinct adapters (the gateway's usage records say which worker answered)
and GPU-slot hit rate (its /metrics: slot hits over admissions during the replay), and the
coefficient of variation of both across workers. The prewarm loop is off (routing alone).

    python bench/fleet.py [--workers 3] [--webs 1] [--adapters 300] [--tenants 5] [--requests 600]
        [--day-seconds 120] [--slots 4] [--cpu-cache 16] [--zipf 1.1] [--max-tokens 8]
        [--kill-worker-at SECONDS] [--policies affinity round_robin] [--seed 0] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, this file's folder heads sys.path; the repository root must be there instead.
sys.path[0] = str(ROOT)

import httpx  # noqa: E402

from bench.fleet_platform import Fleet, Served, adapter_files, register  # noqa: E402
from bench.fleet_report import phase_lines, verdict_lines  # noqa: E402
from bench.fleet_stats import (BROKEN, REFUSED, TIMED_OUT, UNREACHABLE, Outcome, PhaseSummary,  # noqa: E402
                               spread)
from bench.gateway import WORKER_KEY, embedded_platform  # noqa: E402
from bench.prewarm import DAY, Habits, trace  # noqa: E402
from bench.worker_metrics import Samples, scrape_metrics, total, window_metrics  # noqa: E402

PROMPT = "A fleet of workers answers"
FAILOVERS = "loraplex_gateway_failover_retries_total"
EJECTIONS = "loraplex_gateway_worker_ejections_total"


@dataclass
class KillWatch:
    """What the watcher saw after the kill, in seconds from the SIGKILL."""

    registry_drop_s: float | None = None
    last_failover_s: float | None = None
    failovers: float = 0.0
    ejections: float = 0.0
    victim_after: Samples | None = None  # the victim's /metrics just before the kill


async def request(client: httpx.AsyncClient, web: str, served: Served, outcome: Outcome, *, request_id: str,
                  max_tokens: int, timeout_s: float, t0: float) -> None:
    """One streamed completion through `web`; how it ended goes into `outcome`."""
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {served.key}", "X-Request-ID": request_id}
    sent = time.monotonic()
    done = False
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", f"{web}/v1/completions", json=body, headers=headers) as response:
                if response.status_code != 200:
                    outcome.status = REFUSED
                    outcome.detail = f"HTTP {response.status_code}: {(await response.aread())[:160]!r}"
                    return
                async for line in response.aiter_lines():
                    if line.strip() == "data: [DONE]":
                        done = True
                    elif line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            outcome.status, outcome.detail = BROKEN, str(event["error"])[:160]
                            return
                        if outcome.ttft is None and event.get("choices"):
                            outcome.ttft = time.monotonic() - sent
        if not done:
            outcome.status, outcome.detail = BROKEN, "the stream ended without [DONE]"
    except TimeoutError:
        outcome.status, outcome.detail = TIMED_OUT, f"no end within {timeout_s:g} s"
    except httpx.HTTPError as exc:
        outcome.status = BROKEN if outcome.ttft is not None else UNREACHABLE
        outcome.detail = repr(exc)[:160]
    finally:
        outcome.ended_at = time.monotonic() - t0


async def watch_kill(fleet: Fleet, victim: str, at_s: float, t0: float, stop: asyncio.Event) -> KillWatch:
    """At `at_s` into the replay: the victim's /metrics, then SIGKILL; then, until `stop`, when it
    leaves the registry's live list (read as the gateway reads it) and when the gateway's failover
    retries stop growing."""
    import redis.asyncio as aioredis
    from django.conf import settings

    from serving.gateway.routing import live_workers, read_registry
    from serving.contracts.registry import api_key_id

    seen = KillWatch()
    await asyncio.sleep(max(0.0, t0 + at_s - time.monotonic()))
    headers = {"Authorization": f"Bearer {WORKER_KEY}"}
    async with httpx.AsyncClient(base_url=fleet.worker_url(victim), headers=headers) as worker:
        seen.victim_after = await scrape_metrics(worker)
    redis = aioredis.Redis.from_url(settings.REDIS_URL)
    gateway = httpx.AsyncClient(base_url=fleet.web_urls()[0])

    async def counters() -> tuple[float, float]:
        samples = await scrape_metrics(gateway) or []
        return total(samples, FAILOVERS) or 0.0, total(samples, EJECTIONS) or 0.0

    failovers0, ejections0 = await counters()
    killed = time.monotonic()
    await asyncio.to_thread(fleet.kill, victim)
    last = failovers0
    while not stop.is_set():
        now = time.monotonic() - killed
        if seen.registry_drop_s is None:
            live = live_workers(await read_registry(redis), base_models=["tiny-llama"], key_id=api_key_id(WORKER_KEY))
            if victim not in {worker.worker_id for worker in live}:
                seen.registry_drop_s = now
        failovers, ejections = await counters()
        if failovers > last:
            seen.last_failover_s, last = now, failovers
        seen.failovers, seen.ejections = failovers - failovers0, ejections - ejections0
        await asyncio.sleep(0.25)
    await gateway.aclose()
    await redis.aclose()
    return seen


async def replay(fleet: Fleet, day: list[tuple[float, int]], served: list[Served], args: argparse.Namespace
                 ) -> tuple[list[Outcome], dict[str, Samples | None], dict[str, Samples | None], float, KillWatch | None]:
    """The day through the fleet's web processes: the outcomes, each worker's /metrics before and
    after, the replay's wall time and what the kill watcher saw."""
    webs = fleet.web_urls()
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.timeout, connect=5.0))
    base = Served(model="tiny-llama", key=served[0].key)
    # Warm-up on the base model (no adapter: slots untouched): connections, first-request costs.
    for index in range(2 * len(webs) * fleet.workers):
        await request(client, webs[index % len(webs)], base, Outcome(-1, "", 0.0), request_id=f"fleet-warm-{index}",
                      max_tokens=2, timeout_s=args.timeout, t0=time.monotonic())
    headers = {"Authorization": f"Bearer {WORKER_KEY}"}
    workers = {worker_id: httpx.AsyncClient(base_url=fleet.worker_url(worker_id), headers=headers)
               for worker_id in fleet.worker_ids()}
    before = {worker_id: await scrape_metrics(worker) for worker_id, worker in workers.items()}
    scale = args.day_seconds / DAY
    t0 = time.monotonic()
    stop = asyncio.Event()
    victim = fleet.worker_ids()[0]
    watcher = (asyncio.create_task(watch_kill(fleet, victim, args.kill_worker_at, t0, stop))
               if args.kill_worker_at is not None else None)
    outcomes, tasks = [], []
    for seq, (at, index) in enumerate(day):
        await asyncio.sleep(max(0.0, t0 + at * scale - time.monotonic()))
        outcome = Outcome(seq, served[index].model, sent_at=time.monotonic() - t0)
        outcomes.append(outcome)
        tasks.append(asyncio.create_task(request(
            client, webs[seq % len(webs)], served[index], outcome, request_id=f"fleet-{fleet.policy}-{seq}",
            max_tokens=args.max_tokens, timeout_s=args.timeout, t0=t0)))
    await asyncio.gather(*tasks)
    wall = time.monotonic() - t0
    stop.set()
    seen = await watcher if watcher is not None else None
    after = {worker_id: (seen.victim_after if seen is not None and worker_id == victim else await scrape_metrics(worker))
             for worker_id, worker in workers.items()}
    for worker in workers.values():
        await worker.aclose()
    await client.aclose()
    return outcomes, before, after, wall, seen


def usage_of(policy: str, answered: int, timeout_s: float = 20.0) -> list[tuple[str, str, int]]:
    """(worker, adapter, completion tokens) of the policy's requests that a worker answered, from
    the gateway's usage records, once the `answered` ones are all written (flushed every 0.2 s)."""
    from serving.registry.models import UsageRecord

    deadline = time.monotonic() + timeout_s
    while True:
        rows = list(UsageRecord.objects.filter(request_id__startswith=f"fleet-{policy}-", status="ok")
                    .values_list("worker", "adapter", "completion_tokens"))
        if len(rows) >= answered or time.monotonic() > deadline:
            return rows
        time.sleep(0.3)


def run_phase(policy: str, model: Path, day: list[tuple[float, int]], served: list[Served], work: Path,
              args: argparse.Namespace) -> PhaseSummary:
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL)
    client.flushdb()  # the previous phase's registry entries, breakers, outlier records and buckets
    client.close()
    fleet = Fleet(policy=policy, model=model, workers=args.workers, webs=args.webs, slots=args.slots,
                  cpu_cache=args.cpu_cache, logs=work / f"logs-{policy}")
    try:
        fleet.start()
        print(f"{policy}: {args.workers} workers and {args.webs} web process(es) up (their logs: {fleet.logs}); "
              "replaying ...", flush=True)
        outcomes, before, after, wall, seen = asyncio.run(replay(fleet, day, served, args))
    finally:
        fleet.stop()
    answered = sum(outcome.status == "ok" for outcome in outcomes)
    rows = usage_of(policy, answered)
    workers = spread(((worker, adapter) for worker, adapter, _ in rows), fleet.worker_ids())
    for worker_id, entry in workers.items():
        figures = window_metrics(before.get(worker_id), after.get(worker_id), wall)
        entry.slot_hits, entry.slot_misses = figures.get("slot_hits"), figures.get("slot_misses")
        entry.killed = seen is not None and worker_id == fleet.worker_ids()[0]
    summary = PhaseSummary(policy=policy, outcomes=outcomes, workers=workers,
                           completion_tokens=sum(tokens for _, _, tokens in rows))
    if seen is not None:
        summary.registry_drop_s, summary.last_failover_s = seen.registry_drop_s, seen.last_failover_s
        summary.failovers, summary.ejections = seen.failovers, seen.ejections
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--webs", type=int, default=1, help="web processes (the client sends to each in turn)")
    parser.add_argument("--adapters", type=int, default=300)
    parser.add_argument("--tenants", type=int, default=5)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--day-seconds", type=float, default=120.0, help="wall seconds per simulated day")
    parser.add_argument("--slots", type=int, default=4, help="GPU slots per worker (--max-loras)")
    parser.add_argument("--cpu-cache", type=int, default=16, help="CPU-cached adapters per worker (--max-cpu-loras)")
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a request may take in all")
    parser.add_argument("--kill-worker-at", type=float, default=None, help="SIGKILL the first worker this far in")
    parser.add_argument("--policies", nargs="+", default=["affinity", "round_robin"],
                        choices=["affinity", "round_robin"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", default=None,
                        help="adapters kept for the next run, and the last run's process logs (default: under /tmp)")
    args = parser.parse_args()
    if args.workers < 2 or args.webs < 1 or args.adapters < 1 or args.tenants < 1 or args.requests < 1:
        parser.error("needs --workers >= 2 and at least one web process, adapter, tenant and request")
    if args.kill_worker_at is not None and not 0 <= args.kill_worker_at < args.day_seconds:
        parser.error(f"--kill-worker-at must fall within the replay (0 to --day-seconds {args.day_seconds:g})")

    work = Path(args.work_dir) if args.work_dir else Path(tempfile.gettempdir()) / "loraplex-bench-fleet"
    started = time.monotonic()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        model = embedded_platform(Path(tmp))
        directories = adapter_files(model, args.adapters, work)
        served = register(directories, args.tenants, stamp=str(int(time.time())))
        rng = random.Random(args.seed)
        day = trace(Habits.draw(args.adapters, args.zipf, rng), args.requests, rng)
        print(f"{len(served)} adapters registered over {args.tenants} tenants in {time.monotonic() - started:.0f} s; "
              f"the day: {len(day)} requests over {len({index for _, index in day})} distinct adapters in "
              f"{args.day_seconds:g} s", flush=True)
        summaries = [run_phase(policy, model, day, served, work, args) for policy in args.policies]
    print()
    for summary in summaries:
        print("\n".join(phase_lines(summary)))
    print("\n".join(verdict_lines(summaries)))
    print(f"\n{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, load average {load_start[0]:.2f} at the start and {os.getloadavg()[0]:.2f} "
          f"at the end, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {time.monotonic() - started:.0f} s in all; "
          f"command: python bench/fleet.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
