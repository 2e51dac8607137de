"""bench/serve.py's --through-gateway: the launched worker behind `/v1` on W web processes, so
each rate's load runs straight to the worker and then, requests drawn alike (new prompts: none in the prefix cache), as a tenant sends them.

The platform is bench/gateway.py's embedded one (bench.gateway.embedded_platform: SQLite, the
embedded Redis (REDIS_URL where set), local storage, migrated at start) in a temporary directory,
with the launched worker's model as its base model. The worker registers itself in that Redis
(the settings export REDIS_URL and SERVING_WORKER_API_KEY to it) and loads registry versions on
their first request, from the platform's storage. Adapter a<i> that serve.py wrote is uploaded and
deployed as version 1.0.0 of adapter `a<i>` of one tenant on the `bench` tier, whose quotas never
bind (bench.fleet_platform.register), so a request names the same model either way: `a<i>` with
the tenant's key through the gateway; straight to the worker, with the worker's key, the body the
gateway would send it (the version's internal name and artifact, the tenant's prefix-cache salt),
so both paths run on the same adapters in the worker's slots.

The web processes are bench/fleet_platform.py's (lora_platform.launcher.web_argv, the command
line production runs), with no worker of their own; requests go to them in turn, as a load
balancer would. W defaults to what production runs: docker-compose.yml's web service, uvicorn
with $WEB_CONCURRENCY processes, 4 unless set there (docs/benchmarks.md, "Web processes on a GPU
host"); $WEB_CONCURRENCY here overrides it as it does there.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.fleet_platform import VERSION, Fleet, register
from bench.gateway import WORKER_KEY, embedded_platform, wait_up
from bench.serve_launch import Launched

WORKER_ID = "bench-serve"
# The client's comparison of the two paths, per rate (docs/benchmarks.md; issue 22's targets).
ADDED_TTFT_TARGET_MS = 2.0
THROUGHPUT_TARGET = 0.95


def production_web_processes() -> int:
    """How many web processes production runs: $WEB_CONCURRENCY, else docker-compose.yml's default
    for it (read as text: the GPU host has no YAML library to spare)."""
    if os.environ.get("WEB_CONCURRENCY"):
        return int(os.environ["WEB_CONCURRENCY"])
    compose = (Path(__file__).resolve().parents[1] / "docker-compose.yml").read_text()
    default = re.search(r"WEB_CONCURRENCY: \$\{WEB_CONCURRENCY:-(\d+)\}", compose)
    if default is None:
        raise SystemExit("docker-compose.yml's web service sets no WEB_CONCURRENCY default; pass --web-processes")
    return int(default.group(1))


@dataclass
class Gateway:
    """Where the gateway answers and how each path names a model."""

    urls: list[str]
    key: str  # the tenant's API key
    # Per model a request names: the fields the gateway would write into the worker's request.
    upstream: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The web processes, by name (web-0 …): bench/serve.py's --py-spy-dir samples them too.
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)


@contextlib.contextmanager
def gateway_platform(args: argparse.Namespace) -> Iterator[Path]:
    """This process set up as the platform (migrated) in a temporary directory, which it yields; the
    worker launched inside it registers in its Redis and requires the worker key, which the direct
    path then sends (args.api_key)."""
    with tempfile.TemporaryDirectory(prefix="bench-serve-gateway-") as tmp:
        embedded_platform(Path(tmp), redis_url=os.environ.get("REDIS_URL"))
        args.api_key = WORKER_KEY
        yield Path(tmp)


def worker_flags() -> list[str]:
    """The launched worker's registration in the platform's Redis, and its storage as a place it
    may load adapters from."""
    from django.conf import settings

    storage = settings.STORAGE_URL.removeprefix("file://")
    return ["--worker-id", WORKER_ID, "--heartbeat-interval", "1", "--allowed-adapter-path", storage,
            "--redis-url", settings.REDIS_URL]


@contextlib.contextmanager
def started_gateway(args: argparse.Namespace, worker: Launched, work: Path) -> Iterator[Gateway]:
    """The adapters registered on the worker's model as one tenant's, and `args.web_processes` web
    processes routing to the worker, ready (each one's /readyz sees the worker live)."""
    from django.conf import settings

    from serving.registry.models import AdapterVersion

    # The platform's base model is the worker's: uploads are checked against its shapes, and the
    # gateway routes a version to workers serving the base it was registered on.
    settings.BASE_MODEL_PATH, settings.BASE_MODEL_NAME = str(worker.model), args.model
    os.environ.update(BASE_MODEL_PATH=str(worker.model), BASE_MODEL_NAME=args.model)
    started, stamp = time.perf_counter(), str(int(time.time()))
    served = register(worker.adapter_dirs, 1, stamp=stamp)
    versions = AdapterVersion.objects.filter(adapter__tenant__slug__startswith=f"fleet-{stamp}-", version=VERSION)
    salt: dict[str, Any] = {}
    upstream: dict[str, dict[str, Any]] = {}
    for version in versions.select_related("adapter__tenant"):
        salt = {"cache_salt": f"tenant-{version.adapter.tenant_id}"}
        upstream[version.adapter.name] = {
            "model": version.qualified_name, **salt,
            "loraplex_adapter": {"artifact_uri": version.artifact_uri, "manifest_sha256": version.manifest_sha256}}
    upstream[args.model] = salt
    worker.info["register_s"] = time.perf_counter() - started
    print(f"registered {len(served)} adapters as versions of one tenant's in {worker.info['register_s']:.1f}s", flush=True)
    from serving.gateway.routing import RoutingConfig

    # Production's W is one uvicorn with $WEB_CONCURRENCY processes on one port; here they are W
    # uvicorns on W ports (a client cannot reach one process of a shared port), each of which
    # would otherwise start $WEB_CONCURRENCY processes of its own. GATEWAY_PROCESSES (the share of
    # a tier's rate each admits during a Redis outage) is W all the same (Fleet sets it).
    os.environ.pop("WEB_CONCURRENCY", None)
    fleet = Fleet(policy=RoutingConfig.from_environ(os.environ).policy, model=worker.model, workers=0,
                  webs=args.web_processes, slots=0, cpu_cache=0, logs=work / "logs")
    try:
        fleet.start()
        for url in fleet.web_urls():
            wait_up(f"{url}/readyz", fleet.logs, timeout_s=60)
        print(f"{args.web_processes} web process(es) ready at {', '.join(fleet.web_urls())} (logs: {fleet.logs})",
              flush=True)
        yield Gateway(urls=fleet.web_urls(), key=served[0].key, upstream=upstream,
                      processes={child.name: child.process for child in fleet.web_children})
    except BaseException:
        # The logs go with the temporary directory: their tails now, for a run that cannot be repeated at will.
        for log in sorted(fleet.logs.glob("*.log")):
            print(f"--- {log.name} (tail)\n{log.read_text(errors='replace')[-3000:]}", flush=True)
        raise
    finally:
        fleet.stop()


def compare(direct: dict[str, Any], gateway: dict[str, Any]) -> dict[str, Any]:
    """What the gateway did to one rate's figures: its added TTFT and TPOT p50 (ms) and its output
    tok/s as a share of direct's, against issue 22's targets."""
    added = gateway.get("median_ttft_ms", float("nan")) - direct.get("median_ttft_ms", float("nan"))
    ratio = gateway["output_token_throughput"] / direct["output_token_throughput"] \
        if direct["output_token_throughput"] else float("nan")
    return {"request_rate": direct["request_rate"], "popularity": direct["popularity"],
            "direct_tok_s": direct["output_token_throughput"], "gateway_tok_s": gateway["output_token_throughput"],
            "tok_s_ratio": ratio, "direct_ttft_p50_ms": direct.get("median_ttft_ms"),
            "gateway_ttft_p50_ms": gateway.get("median_ttft_ms"), "added_ttft_p50_ms": added,
            "added_tpot_p50_ms": gateway.get("median_tpot_ms", float("nan")) - direct.get("median_tpot_ms", float("nan")),
            "failed": {"direct": direct["failed"], "gateway": gateway["failed"]},
            "meets_targets": added <= ADDED_TTFT_TARGET_MS and ratio >= THROUGHPUT_TARGET}


def print_comparisons(rows: list[dict[str, Any]], web_processes: int) -> None:
    print(f"direct against the gateway ({web_processes} web process(es)); targets: added TTFT p50 <= "
          f"{ADDED_TTFT_TARGET_MS:g} ms, tok/s >= {THROUGHPUT_TARGET:.0%} of direct")
    print(f"{'popularity':>10} {'req/s':>7} {'direct tok/s':>13} {'gw tok/s':>9} {'ratio':>6} {'direct TTFT':>12} "
          f"{'gw TTFT':>8} {'added':>7} {'+TPOT':>6} {'failed':>7} {'met':>4}")
    for r in rows:
        print(f"{r['popularity']:>10} {r['request_rate']:>7g} {r['direct_tok_s']:>13.1f} {r['gateway_tok_s']:>9.1f} "
              f"{r['tok_s_ratio']:>6.1%} {r['direct_ttft_p50_ms'] or 0:>12.1f} {r['gateway_ttft_p50_ms'] or 0:>8.1f} "
              f"{r['added_ttft_p50_ms']:>7.2f} {r['added_tpot_p50_ms']:>6.2f} "
              f"{r['failed']['direct']:>3}/{r['failed']['gateway']:<3} {'yes' if r['meets_targets'] else 'no':>4}")
