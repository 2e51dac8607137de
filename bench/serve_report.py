"""How bench/serve.py prints its figures: a run's summary in vLLM's benchmark_serving layout, with
the worker's adapter figures and its TTFT's phases, and one line per run for a curve."""

from __future__ import annotations

import argparse
from typing import Any


def _figure(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_summary(summary: dict[str, Any], args: argparse.Namespace) -> None:
    window = summary.get("worker", {})
    print("=" * 18 + " Serving Benchmark Result " + "=" * 18)
    picked = f"Adapters ({summary['popularity']} per request)"
    print(f"{picked:<40}{len(args.adapters):>12}")
    print(f"{'Successful requests':<40}{summary['completed']:>12}")
    print(f"{'Failed requests':<40}{summary['failed']:>12}")
    if window.get("cut"):
        print(f"{'  of which cut at the time limit':<40}{window['cut']:>12}")
    print(f"{'Benchmark duration (s)':<40}{summary['duration_s']:>12.2f}")
    print(f"{'Total input tokens':<40}{summary['total_input_tokens']:>12}")
    print(f"{'Total generated tokens':<40}{summary['total_output_tokens']:>12}")
    print(f"{'Request throughput (req/s)':<40}{summary['request_throughput']:>12.2f}")
    print(f"{'Output token throughput (tok/s)':<40}{summary['output_token_throughput']:>12.2f}")
    print(f"{'Total token throughput (tok/s)':<40}{summary['total_token_throughput']:>12.2f}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        if f"mean_{name}_ms" in summary:
            print(f"{'-' * 15}{title:^32}{'-' * 15}")
            for stat in ("mean", "median", "p99"):
                print(f"{f'{stat.capitalize()} {name.upper()} (ms)':<40}{summary[f'{stat}_{name}_ms']:>12.2f}")
    if window.get("metrics"):
        print(f"{'-' * 15}{'Adapters (worker /metrics)':^32}{'-' * 15}")
        hit_rate = window["gpu_hit_rate"]
        print(f"{'GPU hit rate (%)':<40}{_figure(None if hit_rate is None else 100 * hit_rate, '>12.1f')}")
        loads = f"Adapter loads/s ({window['adapter_loads_from']})"
        print(f"{loads:<40}{_figure(window['adapter_loads_per_s'], '>12.2f')}")
        moved = window["bytes_moved_per_s"]
        print(f"{'Host->GPU MB/s':<40}{_figure(None if moved is None else moved / 1e6, '>12.1f')}")
        print(f"{'CPU-cache evictions':<40}{_figure(window['cpu_evictions'], '>12.0f')}")
        print(f"{'Storage reads':<40}{_figure(window['storage_reads'], '>12.0f')}")
        print(f"{'Worker non-ok requests':<40}{window['worker_not_ok']:>12.0f}")
        print(f"{'Engine steps over 250 ms':<40}{_figure(window.get('slow_steps'), '>12.0f')}")
        print(f"{'Step shapes the warm-up missed':<40}{_figure(window.get('cold_step_shapes'), '>12.0f')}")
        for when in ("cold_steps_before", "cold_steps"):
            for step in window.get(when, []):
                lora = " LoRA" if step["lora"] == "true" else ""
                before = " before" if when == "cold_steps_before" else ""
                what = f"  {step['layout']} {step['kernel_tokens']}{lora}, {step['step_tokens']} tok{before} (ms)"
                print(f"{what:<40}{step['ms']:>12.1f}")
        _print_ttft_phases(window.get("ttft_phases_ms", {}))
    print("=" * 62)


# The worker's TTFT and the phases it splits into, in their order (bench/worker_metrics.TTFT_PHASES).
_PHASE_TITLES = (("ttft", "Mean worker TTFT (ms)"), ("admission", "  admission: HTTP to engine (ms)"),
                 ("queue", "  queue: engine to first step (ms)"), ("prefill", "  prefill: to first token (ms)"),
                 ("delivery", "  delivery: token to HTTP (ms)"))


def _print_ttft_phases(means: dict[str, float | None]) -> None:
    """The window's mean TTFT on the worker and its phases' means (nothing from a worker without them)."""
    if means.get("ttft") is None:
        return
    print(f"{'-' * 15}{'TTFT phases (worker /metrics)':^32}{'-' * 15}")
    for key, title in _PHASE_TITLES:
        print(f"{title:<40}{_figure(means.get(key), '.2f'):>12}")


def print_runs(summaries: list[dict[str, Any]]) -> None:
    """One line per run: the latency and throughput figures, and the worker's adapter figures."""
    print(f"{'popularity':>10} {'path':>7} {'req/s':>7} {'got/s':>6} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>9} {'GPU hit':>8} {'loads/s':>8} {'MB/s':>8} {'CPU ev':>7} {'failed':>6}")
    for s in summaries:
        w = s.get("worker", {})
        hit, moved = w.get("gpu_hit_rate"), w.get("bytes_moved_per_s")
        print(f"{s['popularity']:>10} {s.get('path', 'direct'):>7} {s['request_rate']:>7g} {s['request_throughput']:>6.1f} "
              f"{s['output_token_throughput']:>10.1f} {s.get('median_ttft_ms', 0):>9.1f} {s.get('p99_ttft_ms', 0):>9.1f} "
              f"{s.get('median_tpot_ms', 0):>9.1f} {_figure(None if hit is None else 100 * hit, '>7.1f')}% "
              f"{_figure(w.get('adapter_loads_per_s'), '>8.2f')} {_figure(None if moved is None else moved / 1e6, '>8.1f')} "
              f"{_figure(w.get('cpu_evictions'), '>7.0f')} {s['failed']:>6}")
