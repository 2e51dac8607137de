"""The worker's --switch-interval: the interpreter's switch interval (sys.setswitchinterval) the
worker's process runs under, 0.5 ms unless set, applied before the HTTP server starts (the engine
thread and the HTTP loop share the interpreter lock: docs/serving-worker.md)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from serving.engine.server import serve as serve_module
from serving.engine.server.cli import parse_args
from runtime.settings import platform_settings


@pytest.fixture
def interval_seen_by_the_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """The switch interval in force when the worker's HTTP server would start (it does not: its run
    returns at once); the test process's own interval is put back afterwards."""
    seen: list[float] = []
    monkeypatch.setattr(serve_module._WorkerServer, "run",
                        lambda self, sockets=None: seen.append(sys.getswitchinterval()))
    before = sys.getswitchinterval()
    try:
        yield seen
    finally:
        sys.setswitchinterval(before)


def test_the_worker_runs_at_half_a_millisecond_unless_told(tiny_model: Path,
                                                            interval_seen_by_the_server: list[float]) -> None:
    sys.setswitchinterval(0.005)  # CPython's default, whatever the test process had
    assert serve_module.serve(parse_args(["--model", str(tiny_model), "--device", "cpu"])) == 0
    assert interval_seen_by_the_server == [pytest.approx(0.0005)]


def test_the_flag_and_its_variable_set_the_interval(tiny_model: Path, monkeypatch: pytest.MonkeyPatch,
                                                    interval_seen_by_the_server: list[float]) -> None:
    serve_module.serve(parse_args(["--model", str(tiny_model), "--device", "cpu", "--switch-interval", "0.002"]))
    monkeypatch.setenv("SERVING_WORKER_SWITCH_INTERVAL", "0.003")
    platform_settings.cache_clear()
    try:
        serve_module.serve(parse_args(["--model", str(tiny_model), "--device", "cpu"]))
    finally:
        platform_settings.cache_clear()
    assert interval_seen_by_the_server == [pytest.approx(0.002), pytest.approx(0.003)]
