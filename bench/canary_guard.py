"""A failing canary: how many of its own calls until it is out of traffic, and until it is aborted.

The gateway's own decision path runs for every request — the caller and the adapter's served set
from serving.gateway.catalog (its 0.5 s caches included), the version pick by weight, the version's
circuit breaker in Redis, the canary guard and the registry's abort service on a real database —
while the serving worker is stood in for by its answer: every call to the canary fails (500, as a
worker answers when the canary's artifact cannot be loaded), every call to the active version
succeeds. The end-to-end version of the same scenario, through a real web process and worker, is
tests/gateway/test_resilience_breakers_e2e.py.

    python bench/canary_guard.py [--weights 0.05 0.3 0.5 0.9] [--requests 5000] [--concurrency 8]

Needs Redis (REDIS_URL, else the embedded one) and makes its own SQLite database.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def setup_django(directory: Path) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lora_platform.settings")
    os.environ["DATABASE_URL"] = f"sqlite:///{directory / 'bench.sqlite3'}"
    os.environ.setdefault("LORAPLEX_VAR_DIR", str(directory))
    os.environ.setdefault("LOG_LEVEL", "ERROR")
    # Development mode: unset is production, which refuses the development secret key (docs/operations.md).
    os.environ.setdefault("DJANGO_DEBUG", "true")
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def make_adapter(slug: str, weight: float):
    """A tenant with support-bot 1.0.0 active and 1.1.0 as a canary at `weight`; (key, canary row)."""
    from django.conf import settings

    from serving.registry import services
    from serving.registry.models import AdapterVersion
    from tenants.services import tenant_create, tiers_seed

    tiers_seed()
    tenant, key = tenant_create(slug=slug, tier_name="vip", name=slug)
    adapter = services.adapter_create(tenant=tenant, name="support-bot")

    def version(text: str) -> AdapterVersion:
        return AdapterVersion.objects.create(
            adapter=adapter, version=text, artifact_uri=f"file:///bench/{slug}/{text}/",
            manifest_sha256=hashlib.sha256(f"{slug}@{text}".encode()).hexdigest(), base_model=settings.BASE_MODEL_NAME,
            rank=8, lora_alpha=16.0, target_modules=["q_proj"], size_bytes=1, source=AdapterVersion.Source.UPLOAD)

    services.adapter_version_deploy(version=version("1.0.0"), actor="bench")
    canary = services.adapter_canary_start(version=version("1.1.0"), weight=weight, actor="bench")
    return key, canary


async def run_one(weight: float, requests: int, concurrency: int, seed: int) -> dict:
    import redis.asyncio as aioredis
    from asgiref.sync import sync_to_async
    from django.conf import settings

    from serving.gateway import catalog
    from serving.gateway.proxy import UpstreamResult
    from serving.gateway.records import Call
    from serving.gateway.redis_batch import run_batch
    from serving.gateway.version_pick import pick_version
    from serving.gateway.wiring import resilience_build
    from serving.registry.models import DeploymentEvent

    # A name of this run: breakers in Redis outlive the run (their keys expire after a day idle).
    slug = f"bench-{int(weight * 1000)}-{seed}-{os.getpid()}"
    key, canary = await sync_to_async(make_adapter)(slug, weight)
    client = aioredis.Redis.from_url(settings.REDIS_URL)
    resilience = resilience_build(client)
    rng = random.Random(seed)
    caller = await catalog.caller_for(f"Bearer {key}")
    counts = {"requests": 0, "canary_calls": 0}
    opened: dict[str, float] = {}
    started = time.perf_counter()

    async def one() -> None:
        target = await catalog.target_for(caller, "support-bot")
        call = Call(endpoint="completions", caller=caller, body={}, model="support-bot", target=target, max_tokens=1)
        call.version = pick_version(target.served, user=None, rng=rng)
        verdict = await resilience.version_permit(call.version, None, target.served, degradable=False, headers={})
        call.version, call.permit = verdict.version, verdict.permit
        counts["requests"] += 1
        result = UpstreamResult(worker_id="stand-in")
        result.first_byte_s = result.ended_s = 0.005
        to_canary = call.version.version == canary.version
        if to_canary:
            counts["canary_calls"] += 1
            result.http_status, result.status = 500, "upstream_error"
        else:
            result.http_status, result.status = 200, "ok"
        # What the pipeline's settling does: the outcome's counts in one round trip, then the verdict.
        replies = await run_batch(client, resilience.outcome_calls(call, result))
        await resilience.outcome_recorded(call, result, replies)
        if to_canary and "wall" not in opened:
            snapshot = await resilience.breakers.snapshot(canary.qualified_name)
            if snapshot.state.value == "open":
                opened.update(wall=time.time(), call=counts["canary_calls"])

    async def client_loop() -> None:
        while counts["requests"] < requests:
            await one()

    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    await asyncio.gather(*resilience.tasks)
    events = await sync_to_async(lambda: list(
        DeploymentEvent.objects.filter(tenant__slug=slug, actor="system:canary-guard").values_list("created_at", "reason")))()
    await client.aclose()
    return {
        "weight": weight, "requests": counts["requests"], "canary_calls": counts["canary_calls"],
        "opened_at_call": opened.get("call"), "audit_events": len(events), "reason": events[0][1] if events else "",
        "open_to_abort_ms": (events[0][0].timestamp() - opened["wall"]) * 1000 if events and opened else None,
        "seconds": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", type=float, nargs="+", default=[0.05, 0.3, 0.5, 0.9])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        setup_django(Path(directory))
        print(f"# {platform.node()} {platform.processor() or platform.machine()}, python {platform.python_version()}, "
              f"{args.requests} requests per weight, {args.concurrency} concurrent")
        print("| canary weight | requests | canary calls in all | breaker open at canary call | "
              "breaker open → abort committed | guard audit events |")
        print("| --- | --- | --- | --- | --- | --- |")
        reasons = []
        for weight in args.weights:
            row = asyncio.run(run_one(weight, args.requests, args.concurrency, args.seed))
            delay = f"{row['open_to_abort_ms']:.0f} ms" if row["open_to_abort_ms"] is not None else "-"
            print(f"| {row['weight']} | {row['requests']} | {row['canary_calls']} | {row['opened_at_call']} | "
                  f"{delay} | {row['audit_events']} |")
            reasons.append(row["reason"])
        for reason in reasons:
            print(f"reason: {reason}")


if __name__ == "__main__":
    main()
