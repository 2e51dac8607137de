"""Tenant isolation of cost (issue 37): tenant B runs a steady load while tenant A runs, in turn, each
hostile pattern of the attack run; B's TTFT p50/p99 and output throughput against B alone, and A's
outcome (status codes, the first error, and what A was charged where that is the point).

The platform is bench/fleet_platform.py's (bench.gateway.embedded_platform: SQLite, the embedded
Redis, local storage) with K serving workers behind one web process; A and B are two tenants on the
same tier (`bench`, whose rate limits do not bind, so what B sees is the shared workers and
gateway, not A's quota), each with one adapter. B's load: Poisson arrivals at `--b-rate` of
streamed `/v1/completions` on B's adapter for `--seconds`; every pattern's window is the same
length and seed, so only A differs. A's pattern runs until B's window ends, `--a-concurrency`
requests at a time: its hostile requests paced at `--a-rate` a second (what one such request costs
the others is the measure; a raw request rate is bounded by the tier's rpm and the web server's
per-client connection cap), the flood unpaced; the budget pattern fires its 200 concurrent requests
once.

    python bench/noisy_neighbour.py                                  # tiny model on CPU, 2 workers
    python bench/noisy_neighbour.py --patterns alone,deep_schema,flood --seconds 20
    python bench/noisy_neighbour.py --shape llama3-8b --workers 1 --b-rate 16 --prompt-words 200 \
        --max-tokens 128 --json noisy8b.json                         # the GPU host (random weights)
    python bench/noisy_neighbour.py --patterns alone,flood,alone --worker-flags=--engine-process
                                                                     # the workers with other flags

The targets (issue 37): under every pattern B's TTFT p50 within 1.5 x and p99 within 2 x of B
alone, B's throughput at least 90 %; A's budgeted key never over its budget by more than one
request's reservation. They are printed beside the figures, never asserted (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway import embedded_platform, percentile  # noqa: E402
from bench.fleet_platform import Fleet, Served, register  # noqa: E402

BUDGET_TOKENS = 250
WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls watch".split()


@dataclass
class Tenants:
    url: str  # the web process
    a: Served
    b: Served
    a_budget_key: str  # A's key with a monthly budget of BUDGET_TOKENS
    a_budget_prefix: str


@dataclass
class Outcome:
    statuses: Counter[int] = field(default_factory=Counter)
    first_error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def note(self, status: int, text: str) -> None:
        self.statuses[status] += 1
        if status >= 400 and not self.first_error:
            self.first_error = f"{status} {text[:160]}"


# ---- A's patterns: each builds one request body (chat or completions) -------------------------


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


def deep_schema(a: Served) -> tuple[str, Any]:
    schema = nested_schema(400)
    return "chat", {"model": a.model, "messages": [{"role": "user", "content": "fill it"}], "max_tokens": 16,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}}


def stop_flood(a: Served) -> tuple[str, Any]:
    stops = [f"stop-{index:06d}" for index in range(95_000)]
    return "completions", {"model": a.model, "prompt": "tell me", "max_tokens": 256, "n": 16, "stop": stops}


def tools_flood(a: Served) -> tuple[str, Any]:
    tools = [{"type": "function", "function": {"name": f"tool_{index}", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}} for index in range(19_000)]
    return "chat", {"model": a.model, "messages": [{"role": "user", "content": "call"}], "tools": tools,
                    "tool_choice": {"type": "function", "function": {"name": "missing"}}, "max_tokens": 16}


def nan_temperature(a: Served) -> tuple[str, Any]:
    # Raw text: the client's own encoder refuses NaN, which is the point.
    return "completions", f'{{"model": "{a.model}", "prompt": "hi", "max_tokens": 8, "temperature": NaN}}'


def bad_grammar(a: Served) -> tuple[str, Any]:
    return "completions", {"model": a.model, "prompt": "hi", "max_tokens": 8, "guided_grammar": "root ::= root root"}


def deep_body(a: Served) -> tuple[str, Any]:
    return "completions", '{"model": "' + a.model + '", "prompt": "hi", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"


def flood(a: Served) -> tuple[str, Any]:
    return "completions", {"model": a.model, "prompt": " ".join(WORDS * 8), "max_tokens": 128, "ignore_eos": True}


def best_of(a: Served) -> tuple[str, Any]:
    return "completions", {"model": a.model, "prompt": "hi", "max_tokens": 32, "best_of": 8, "n": 1,
                           "ignore_eos": True, "temperature": 1.0}


BODIES: dict[str, Callable[[Served], tuple[str, Any]]] = {
    "deep_schema": deep_schema, "stop_flood": stop_flood, "tools_flood": tools_flood,
    "nan": nan_temperature, "bad_grammar": bad_grammar, "deep_body": deep_body, "flood": flood, "best_of": best_of,
}
PATTERNS = ["alone", *BODIES, "budget"]
# B alone first and last: the baseline is their mean, so a drift over the run (a worker's first
# minute, the machine's other load) weighs on both sides.
DEFAULT_PATTERNS = [*PATTERNS, "alone"]
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def encoded(body: Any) -> bytes:
    """A request's bytes, encoded once: a megabyte's json.dumps per request would stall this
    process's event loop, which also times B's requests."""
    return (body if isinstance(body, str) else json.dumps(body)).encode()


async def send(client: httpx.AsyncClient, url: str, key: str, endpoint: str, content: bytes) -> tuple[int, str, dict]:
    """One non-streamed request: (status, body text, the usage object or {})."""
    try:
        response = await client.post(f"{url}{PATHS[endpoint]}", content=content,
                                     headers={"Authorization": f"Bearer {key}", "content-type": "application/json"})
    except httpx.HTTPError as exc:
        return 0, repr(exc), {}
    usage: dict[str, Any] = {}
    if response.status_code == 200:
        try:
            usage = response.json().get("usage") or {}
        except ValueError:
            pass
    return response.status_code, response.text, usage


async def run_a(pattern: str, tenants: Tenants, stop: asyncio.Event, concurrency: int, rate: float) -> Outcome:
    outcome = Outcome()
    async with httpx.AsyncClient(timeout=300) as client:
        if pattern == "budget":
            body = {"model": tenants.a.model, "prompt": "hi", "max_tokens": 8, "ignore_eos": True}
            replies = await asyncio.gather(*(send(client, tenants.url, tenants.a_budget_key, "completions",
                                                  encoded(body))
                                             for _ in range(200)))
            for status, text, _ in replies:
                outcome.note(status, text)
            used = sum(usage.get("total_tokens", 0) for _, _, usage in replies)
            outcome.extra.update(budget=BUDGET_TOKENS, served=outcome.statuses[200], tokens_used=used)
            return outcome
        endpoint, body = BODIES[pattern](tenants.a)
        content = encoded(body)
        generated = 0
        # Hostile requests at a steady pace (the flood: as many as its concurrency keeps in flight), so
        # each pattern is measured by what one such request costs the others, not by a raw request
        # rate, which the tier's rpm and the web server's per-client connection cap bound.
        pace = 0.0 if pattern == "flood" else 1.0 / rate
        next_at = time.perf_counter()

        async def loop() -> None:
            nonlocal generated, next_at
            while not stop.is_set():
                if pace:
                    wait, next_at = max(0.0, next_at - time.perf_counter()), max(next_at, time.perf_counter()) + pace
                    await asyncio.sleep(wait)
                    if stop.is_set():
                        return
                status, text, usage = await send(client, tenants.url, tenants.a.key, endpoint, content)
                outcome.note(status, text)
                generated += usage.get("completion_tokens", 0)

        await asyncio.gather(*(loop() for _ in range(concurrency)))
        if pattern == "best_of":
            outcome.extra["completion_tokens_reported"] = generated
    return outcome


# ---- B's steady load ---------------------------------------------------------------------------


@dataclass
class BSample:
    ttft: float
    tokens: int


async def b_one(client: httpx.AsyncClient, url: str, b: Served, prompt: str, max_tokens: int) -> BSample | None:
    """One streamed completion of B's; TTFT to the first chunk carrying token ids (a random model's
    tokens may decode to no text), tokens from the stream's usage."""
    body = {"model": b.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    start = time.perf_counter()
    ttft, tokens = None, 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {b.key}"}) as response:
            if response.status_code != 200:
                return None
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if ttft is None and chunk.get("choices") and chunk["choices"][0].get("token_ids"):
                    ttft = time.perf_counter() - start
    except httpx.HTTPError:
        return None
    return BSample(ttft=ttft if ttft is not None else float("nan"), tokens=tokens)


async def run_b(args: argparse.Namespace, tenants: Tenants) -> dict[str, Any]:
    rng = random.Random(args.seed)
    samples: list[BSample | None] = []
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=1000)) as client:
        tasks: list[Awaitable[None]] = []
        start = time.perf_counter()
        next_at = start
        while next_at - start < args.seconds:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            prompt = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))

            async def one(prompt: str = prompt) -> None:
                samples.append(await b_one(client, tenants.url, tenants.b, prompt, args.max_tokens))

            tasks.append(asyncio.ensure_future(one()))
            next_at += rng.expovariate(args.b_rate)
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    done = [sample for sample in samples if sample is not None]
    ttfts = [sample.ttft * 1000 for sample in done]
    return {"requests": len(samples), "failed": len(samples) - len(done),
            "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
            "output_tok_s": sum(sample.tokens for sample in done) / elapsed}


def a_process(pattern: str, tenants: Tenants, concurrency: int, rate: float, stop: Any, out: Any) -> None:
    """A's client, a process of its own (as a second tenant's would be): its requests' encoding and
    replies never share the event loop that times B's."""

    async def main() -> Outcome:
        stopped = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                await asyncio.sleep(0.05)
            stopped.set()

        watcher = asyncio.ensure_future(watch())
        try:
            return await run_a(pattern, tenants, stopped, concurrency, rate)
        finally:
            watcher.cancel()

    out.put(asyncio.run(main()))


def window(args: argparse.Namespace, tenants: Tenants, pattern: str) -> dict[str, Any]:
    """B's load for one window while A runs `pattern` in a process of its own (forked here, outside
    any event loop)."""
    outcome, a = Outcome(), None
    if pattern != "alone":
        context = multiprocessing.get_context("fork")
        stop, out = context.Event(), context.SimpleQueue()
        a = context.Process(target=a_process, args=(pattern, tenants, args.a_concurrency, args.a_rate, stop, out),
                            daemon=True)
        a.start()
    b = asyncio.run(run_b(args, tenants))
    if a is not None:
        stop.set()
        outcome = out.get()
        a.join(60)
    # The host's 1-minute load at the window's end: on a shared machine, a window's figures are
    # comparable with another's only at a like load.
    row: dict[str, Any] = {"pattern": pattern, "b": b, "load": round(os.getloadavg()[0], 1),
                           "a": {"statuses": dict(outcome.statuses), "first_error": outcome.first_error,
                                 **outcome.extra}}
    if pattern == "budget":
        row["a"]["recorded_tokens"] = recorded_tokens(tenants.a_budget_prefix)
    return row


def recorded_tokens(prefix: str, settle_s: float = 5.0) -> int:
    """The budgeted key's tokens in the usage records once the gateway's flusher has written them."""
    from django.db.models import Sum

    from serving.registry.models import UsageRecord

    time.sleep(settle_s)  # the flusher's interval is 0.2 s here; a few rounds of it
    totals = UsageRecord.objects.filter(api_key_prefix=prefix).aggregate(p=Sum("prompt_tokens"),
                                                                          c=Sum("completion_tokens"))
    return (totals["p"] or 0) + (totals["c"] or 0)


# ---- set-up and report -------------------------------------------------------------------------


def start_platform(args: argparse.Namespace, work: Path) -> tuple[Fleet, Tenants]:
    embedded_platform(work)
    from django.conf import settings

    from bench.serve_launch import prepare

    # The bench's model and two rank-16 adapters on every projection (bench/serve_launch.py's), the
    # platform's base model from here on, so the registry checks the adapters against it.
    shape = argparse.Namespace(launch=args.shape, adapter_cache=None, num_adapters=2, rank=16, adapter_modules="all")
    model, adapters, flags, _, _ = prepare(shape, work)
    if args.shape == "llama3-8b":  # the workers share one GPU
        flags = [*flags, "--gpu-memory-utilization", str(round(0.85 / args.workers, 2))]
    flags = [*flags, *shlex.split(args.worker_flags)]
    os.environ["BASE_MODEL_PATH"] = settings.BASE_MODEL_PATH = str(model)
    from tenants.api_keys import parse_key
    from tenants.models import ApiKey
    from tenants.services import api_key_create

    served = register(adapters, 2, f"noisy{int(time.time())}")  # a0 to tenant A, a1 to tenant B
    parsed = parse_key(served[0].key)
    assert parsed is not None, "register() hands out well-formed keys"
    tenant_a = ApiKey.objects.get(prefix=parsed.prefix).tenant
    budget_key, budget_full = api_key_create(tenant=tenant_a, name="budgeted",
                                             controls={"monthly_token_budget": BUDGET_TOKENS})
    fleet = Fleet(policy="affinity", model=model, workers=args.workers, webs=1, slots=4, cpu_cache=4,
                  logs=work / "logs", rank=16, worker_flags=tuple(flags))
    fleet.start()
    tenants = Tenants(url=fleet.web_urls()[0], a=served[0], b=served[1], a_budget_key=budget_full,
                      a_budget_prefix=budget_key.prefix)
    return fleet, tenants


def neighbours(rows: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """B's figures of the `alone` windows next to window `index` (the last before it, the first after):
    on a shared host the load drifts over a run, and the windows on either side saw the closest to it."""
    before = [row["b"] for row in rows[:index] if row["pattern"] == "alone"][-1:]
    after = [row["b"] for row in rows[index + 1:] if row["pattern"] == "alone"][:1]
    return before + after


def report(rows: list[dict[str, Any]]) -> None:
    alones = [row["b"] for row in rows if row["pattern"] == "alone"]
    alone = ({name: statistics.fmean(b[name] for b in alones) for name in ("ttft_p50_ms", "ttft_p99_ms", "output_tok_s")}
             if alones else None)
    print(f"{'pattern':<13}{'B p50 ms':>10}{'B p99 ms':>10}{'B tok/s':>9}{'p50 x':>7}{'p99 x':>7}{'tok %':>7}"
          f"{'B fail':>7}{'load':>6}  A's outcome")
    for row in rows:
        b = row["b"]
        ratios = ""
        if alone is not None:
            p50, p99 = b["ttft_p50_ms"] / alone["ttft_p50_ms"], b["ttft_p99_ms"] / alone["ttft_p99_ms"]
            share = 100 * b["output_tok_s"] / alone["output_tok_s"]
            ok = p50 <= 1.5 and p99 <= 2.0 and share >= 90
            ratios = f"{p50:>7.2f}{p99:>7.2f}{share:>7.1f}" + ("" if ok else " !")
        a = {key: value for key, value in row["a"].items() if value not in ({}, "")}
        print(f"{row['pattern']:<13}{b['ttft_p50_ms']:>10.1f}{b['ttft_p99_ms']:>10.1f}{b['output_tok_s']:>9.1f}"
              f"{ratios:<23}{b['failed']:>5}{row.get('load', float('nan')):>6.1f}  {json.dumps(a)[:200]}")
    # The same ratios against each window's neighbouring alone windows only (x alone is against all).
    for index, row in enumerate(rows):
        near = neighbours(rows, index)
        if row["pattern"] != "alone" and near:
            p50, p99 = (row["b"][name] / statistics.fmean(b[name] for b in near)
                        for name in ("ttft_p50_ms", "ttft_p99_ms"))
            print(f"{row['pattern']} (window {index + 1}) against the alone windows beside it: p50 {p50:.2f} x, "
                  f"p99 {p99:.2f} x")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny", choices=["tiny", "small", "llama3-8b"])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--patterns", default=",".join(DEFAULT_PATTERNS))
    p.add_argument("--warmup-seconds", type=float, default=10.0, help="B's load before the first window, unmeasured")
    p.add_argument("--seconds", type=float, default=15.0, help="each window's length")
    p.add_argument("--b-rate", type=float, default=4.0, help="B's requests per second")
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--a-concurrency", type=int, default=4, help="A's requests in flight at most")
    p.add_argument("--a-rate", type=float, default=20.0, help="A's hostile requests a second (not the flood's)")
    p.add_argument("--worker-flags", default="", help="more serving-worker flags, as one shell-quoted string")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    args = p.parse_args()
    patterns = args.patterns.split(",")
    unknown = set(patterns) - set(PATTERNS)
    if unknown:
        p.error(f"unknown pattern(s) {sorted(unknown)}; choose from {PATTERNS}")
    with tempfile.TemporaryDirectory(prefix="bench-noisy-") as tmp:
        fleet, tenants = start_platform(args, Path(tmp))
        try:
            warm_up = argparse.Namespace(**{**vars(args), "seconds": args.warmup_seconds})
            asyncio.run(run_b(warm_up, tenants))
            rows = []
            for pattern in patterns:
                rows.append(window(args, tenants, pattern))
                print(f"{pattern}: B {rows[-1]['b']}, A {rows[-1]['a']}", flush=True)
        finally:
            fleet.stop()
    print(f"\n{platform.node()} {platform.processor() or platform.machine()}, shape {args.shape}, "
          f"{args.workers} workers, B at {args.b_rate} req/s for {args.seconds:.0f} s a pattern")
    report(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
