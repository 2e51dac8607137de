"""The web process's memory after completion requests that each name a new, long `model` (docs/security.md:
350 requests with a distinct 1.9 MB name took a web process from 385 MB to 2,441 MB).

Runs the gateway's request path (serving.gateway.wiring.handle, what the ASGI route calls) in
this process, with a valid key, and prints this process's RSS before and after, and what the
gateway's key and model caches hold. Needs DATABASE_URL (migrated here) and REDIS_URL:

    DATABASE_URL=sqlite:////tmp/gw-bench.sqlite3 REDIS_URL=redis://127.0.0.1:6379/5 \
        .venv/bin/python bench/gateway_model_names.py --requests 350 --model-bytes 1900000
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import uuid
from collections import Counter

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lora_platform.settings")
os.environ.setdefault("GATEWAY_PREWARM_INTERVAL_SECONDS", "0")
# Development mode: unset is production, which refuses the development secret key (docs/operations.md).
os.environ.setdefault("DJANGO_DEBUG", "true")

import django  # noqa: E402

django.setup()

import psutil  # noqa: E402
from django.core.management import call_command  # noqa: E402

from serving.gateway import catalog, wiring  # noqa: E402
from serving.gateway.errors import GatewayError  # noqa: E402
from tenants.services import tenant_create, tiers_seed  # noqa: E402


def rss_mb() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 1e6


def cache_figures() -> str:
    parts = []
    for name in ("_callers", "_targets"):
        cache = getattr(catalog, name)
        size = getattr(cache, "bytes", None)
        entries = len(cache) if hasattr(cache, "__len__") else len(getattr(cache, "_entries", {}))
        parts.append(f"{name}: {entries} entries" + (f", {size / 1e6:.1f} MB counted" if size is not None else ""))
    return "; ".join(parts)


async def flood(key: str, requests: int, model_bytes: int) -> Counter[int]:
    statuses: Counter[int] = Counter()
    for index in range(requests):
        model = f"{index}-".ljust(model_bytes, "m")
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        try:
            reply = await wiring.handle("chat", authorization=f"Bearer {key}", raw_body=body.encode())
            statuses[reply.status] += 1
        except GatewayError as error:
            statuses[error.status] += 1
    return statuses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=350)
    parser.add_argument("--model-bytes", type=int, default=1_900_000)
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    tiers_seed()
    _, key = tenant_create(slug=f"bench-{uuid.uuid4().hex[:8]}", tier_name="vip")
    before = rss_mb()
    statuses = asyncio.run(flood(key, args.requests, args.model_bytes))
    after = rss_mb()
    print(f"{args.requests} requests, model names of {args.model_bytes} bytes: statuses {dict(statuses)}")
    print(f"RSS before {before:.0f} MB, after {after:.0f} MB (+{after - before:.0f} MB); {cache_figures()}")


if __name__ == "__main__":
    main()
