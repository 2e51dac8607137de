"""bench/serve.py's reading of the worker's cold steps (loraplex_engine_cold_step_seconds): a run's
window lists the keys first met in it, slowest first, apart from those met before it (the bench's
own warm-up), and the summary prints each with its step's token count, and the window's slow steps."""

from __future__ import annotations

import argparse

import pytest

from bench.serve_report import print_summary
from bench.worker_metrics import Samples, cold_steps, window_metrics

NAME = "loraplex_engine_cold_step_seconds"


def cold(layout: str, kernel: int, lora: bool, tokens: int, seconds: float) -> tuple[str, dict[str, str], float]:
    return (NAME, {"layout": layout, "kernel_tokens": str(kernel), "lora": str(lora).lower(), "step_tokens": str(tokens)},
            seconds)


def test_a_window_lists_the_cold_steps_first_met_in_it_slowest_first(capsys: pytest.CaptureFixture[str]) -> None:
    before: Samples = [cold("graph", 448, True, 431, 0.02), ("loraplex_engine_cold_step_shapes", {}, 1.0),
                       ("loraplex_engine_slow_steps_total", {}, 2.0)]
    after: Samples = [*before[:1], cold("graph", 1536, True, 1490, 0.4), cold("eager", 0, True, 2730, 1.5),
                      ("loraplex_engine_cold_step_shapes", {}, 3.0), ("loraplex_engine_slow_steps_total", {}, 9.0)]
    assert [(s["layout"], s["kernel_tokens"], s["step_tokens"], s["ms"]) for s in cold_steps(before, after)] == [
        ("eager", "0", "2730", 1500.0), ("graph", "1536", "1490", 400.0)]
    window = window_metrics(before, after, duration=10.0)
    assert window["cold_step_shapes"] == 2 and window["slow_steps"] == 7
    assert [s["kernel_tokens"] for s in window["cold_steps_before"]] == ["448"]
    summary = {"popularity": "uniform", "completed": 1, "failed": 0, "duration_s": 10.0, "total_input_tokens": 1,
               "total_output_tokens": 1, "request_throughput": 0.1, "output_token_throughput": 0.1,
               "total_token_throughput": 0.2, "worker": window}
    print_summary(summary, argparse.Namespace(adapters=["a0"]))
    printed = capsys.readouterr().out
    assert "eager 0 LoRA, 2730 tok (ms)" in printed and "1500.0" in printed
    assert "graph 448 LoRA, 431 tok before (ms)" in printed
    assert any(line.startswith("Engine steps over 250 ms") and line.endswith(" 7") for line in printed.splitlines())
