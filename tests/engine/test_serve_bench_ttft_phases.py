"""bench/serve.py's reading of the worker's TTFT breakdown (loraplex_request_*_seconds beside
loraplex_time_to_first_token_seconds): a run's window has each one's mean over the requests the
window observed, from the histograms' _sum and _count deltas, None for one the worker lacks, and
the summary prints them as a block under the worker's figures."""

from __future__ import annotations

import argparse

import pytest

from bench.serve_report import print_summary
from bench.worker_metrics import Samples, TTFT_PHASES, window_metrics


def histogram(key: str, seconds: float, count: float) -> Samples:
    name = TTFT_PHASES[key]
    return [(f"{name}_sum", {}, seconds), (f"{name}_count", {}, count), (f"{name}_bucket", {"le": "+Inf"}, count)]


def summary(window: dict[str, object]) -> dict[str, object]:
    return {"popularity": "uniform", "completed": 4, "failed": 0, "duration_s": 1.0, "total_input_tokens": 1,
            "total_output_tokens": 1, "request_throughput": 4.0, "output_token_throughput": 1.0,
            "total_token_throughput": 2.0, "worker": window}


def test_a_window_has_the_mean_of_the_ttft_and_of_each_phase(capsys: pytest.CaptureFixture[str]) -> None:
    # Two requests before the window, four in it: a mean over the four only.
    before: Samples = [*histogram("ttft", 1.0, 2), *histogram("admission", 0.1, 2), *histogram("queue", 0.2, 2),
                       *histogram("prefill", 0.5, 2), *histogram("delivery", 0.1, 2)]
    after: Samples = [*histogram("ttft", 1.2, 6), *histogram("admission", 0.104, 6), *histogram("queue", 0.24, 6),
                      *histogram("prefill", 0.64, 6), *histogram("delivery", 0.112, 6)]
    window = window_metrics(before, after, duration=1.0)
    assert window["ttft_phases_ms"] == pytest.approx({"ttft": 50.0, "admission": 1.0, "queue": 10.0, "prefill": 35.0,
                                                      "delivery": 3.0})
    print_summary(summary(window), argparse.Namespace(adapters=[]))
    lines = capsys.readouterr().out.splitlines()
    block = lines[lines.index(next(line for line in lines if "TTFT phases (worker /metrics)" in line)) + 1:][:5]
    assert [line.split()[-1] for line in block] == ["50.00", "1.00", "10.00", "35.00", "3.00"]
    assert block[2].startswith("  queue")


def test_a_phase_the_worker_lacks_or_a_window_without_requests_has_no_mean(capsys: pytest.CaptureFixture[str]) -> None:
    # An older worker: the TTFT only.
    older = window_metrics(histogram("ttft", 1.0, 2), histogram("ttft", 1.3, 5), duration=1.0)
    assert older["ttft_phases_ms"] == {"ttft": pytest.approx(100.0), "admission": None, "queue": None, "prefill": None,
                                       "delivery": None}
    print_summary(summary(older), argparse.Namespace(adapters=[]))
    printed = capsys.readouterr().out
    assert any(line.startswith("  prefill") and line.endswith("n/a") for line in printed.splitlines())
    idle = window_metrics(histogram("ttft", 1.0, 2), histogram("ttft", 1.0, 2), duration=1.0)
    assert idle["ttft_phases_ms"]["ttft"] is None
    print_summary(summary(idle), argparse.Namespace(adapters=[]))
    assert "TTFT phases" not in capsys.readouterr().out
