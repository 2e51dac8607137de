"""bench/fleet.py's printout: per policy its figures and per worker its share, and the verdict on
issue 28's target (CPU, 3 workers, 300 adapters, Zipf: affinity's GPU-slot hit rate at least
1.5 × round robin's, with TTFT p99 no worse)."""

from __future__ import annotations

import math

from bench.fleet_stats import PhaseSummary, quantile

TARGET_HIT_RATIO = 1.5


def _pct(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.1%}"


def _ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value * 1000:.0f} ms"


def phase_lines(summary: PhaseSummary) -> list[str]:
    ttfts = summary.ttfts()
    wall = summary.wall_s()
    failed = summary.failed()
    lines = [
        f"{summary.policy}: {len(summary.outcomes)} requests, {len(summary.ok)} ok, failed "
        f"{sum(failed.values())}{' (' + ', '.join(f'{k} {v}' for k, v in sorted(failed.items())) + ')' if failed else ''}; "
        f"throughput {len(summary.ok) / wall if wall else math.nan:.2f} req/s, "
        f"{summary.completion_tokens / wall if wall else math.nan:.1f} tokens/s over {wall:.0f} s; "
        f"TTFT p50 {_ms(quantile(ttfts, 0.5))} p99 {_ms(quantile(ttfts, 0.99))}",
        f"  GPU-slot hit rate {_pct(summary.hit_rate())}; spread across workers: requests CV "
        f"{summary.request_cv():.2f}, distinct adapters CV {summary.adapter_cv():.2f}, a worker serves "
        f"{_pct(summary.adapters_per_worker())} of the adapters served (1/K: each adapter on one worker)",
    ]
    answered = sum(worker.requests for worker in summary.workers.values()) or 1
    for worker in summary.workers.values():
        lines.append(f"    {worker.worker_id}{' (killed)' if worker.killed else ''}: {worker.requests / answered:.1%} "
                     f"of requests, {len(worker.adapters)} distinct adapters, GPU-slot hit rate "
                     f"{_pct(worker.hit_rate)}")
    if summary.registry_drop_s is not None or summary.failovers:
        drop = f"{summary.registry_drop_s:.1f} s" if summary.registry_drop_s is not None else "not within the replay"
        last = f"{summary.last_failover_s:.1f} s" if summary.last_failover_s is not None else "none"
        lines.append(f"  worker killed: out of the registry's live list after {drop}; {summary.failovers:.0f} "
                     f"failover retries, the last {last} after the kill; {summary.ejections:.0f} outlier ejections")
    examples = {outcome.status: outcome.detail for outcome in summary.outcomes if outcome.status != "ok"}
    lines += [f"  e.g. {status}: {detail}" for status, detail in sorted(examples.items())]
    return lines


def verdict_lines(summaries: list[PhaseSummary]) -> list[str]:
    by_policy = {summary.policy: summary for summary in summaries}
    affinity, round_robin = by_policy.get("affinity"), by_policy.get("round_robin")
    if affinity is None or round_robin is None:
        return []
    hit_a, hit_r = affinity.hit_rate(), round_robin.hit_rate()
    p99_a, p99_r = quantile(affinity.ttfts(), 0.99), quantile(round_robin.ttfts(), 0.99)
    ratio = hit_a / hit_r if hit_a is not None and hit_r else math.nan
    hits_met = ratio >= TARGET_HIT_RATIO
    p99_met = p99_a <= p99_r
    return [f"\naffinity / round robin: GPU-slot hit rate {_pct(hit_a)} / {_pct(hit_r)} = {ratio:.2f}x "
            f"(target >= {TARGET_HIT_RATIO}x: {'met' if hits_met else 'not met'}); TTFT p99 {_ms(p99_a)} / {_ms(p99_r)} "
            f"(target no worse: {'met' if p99_met else 'not met'})"]
