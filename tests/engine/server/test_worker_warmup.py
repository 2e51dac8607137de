"""The worker is ready only once its warm-up has run (serving.engine.warmup; docs/serving-worker.md,
"Warm-up: the first minute"): `/health` answers 503 "loading" as long as the warm-up's report does
not exist, and the report covers every decode batch size and sampler path with the adapters named
at launch left resident; then text requests through the worker's own routes (the HTTP warm-up),
which nobody else's request gets through while it loads. After it, the first step of each kernel key
the warm-up missed is a labelled /metrics series. On CPU the warm-up is off unless asked (`--warmup`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from serving.engine.server.app import build_app
from serving.engine.server.cli import LoRAModule, ServerArgs
from serving.engine.server.http_warmup import http_warmup_requests
from serving.engine.server.worker import Worker, warms_up
from serving.engine.warmup import SAMPLER_PATHS

MAX_SEQS = 4


def test_the_warm_up_is_on_for_cuda_and_off_on_cpu_unless_asked() -> None:
    assert warms_up(None, "cuda") and not warms_up(None, "cpu")
    assert warms_up(True, "cpu") and not warms_up(False, "cuda")


@pytest.mark.e2e  # the warm-up's guided request starts the grammar compiler's processes
def test_health_is_loading_until_the_warm_up_has_run(tiny_model: Path, make_adapter: Callable[..., Path]) -> None:
    adapters = [LoRAModule("first", str(make_adapter(seed=11))), LoRAModule("second", str(make_adapter(seed=12)))]
    worker = Worker(ServerArgs(model=str(tiny_model), device="cpu", max_model_len=128, num_gpu_blocks_override=256,
                               max_num_seqs=MAX_SEQS, max_num_batched_tokens=64, max_loras=2, lora_modules=adapters,
                               slot_verify_interval=0, warmup=True))  # fmt: skip
    polls = 0
    with TestClient(build_app(worker)) as client:
        deadline = time.monotonic() + 120
        while True:
            # /health is asked before the report is read: a 200 means the report must exist by then.
            health = client.get("/health")
            report = worker.warmup_report
            polls += 1
            if health.status_code == 200:
                assert report is not None, "ready before the warm-up ended"
                break
            assert health.status_code == 503 and health.json() == {"status": "loading"}, health.text
            # While the HTTP warm-up's own requests pass, an outside one is still refused.
            outside = client.post("/v1/completions", json={"model": "first", "prompt": "Hi", "max_tokens": 1})
            assert outside.status_code == 503 or worker.warmup_report is not None, outside.text
            assert time.monotonic() < deadline, "the worker never became ready"
            time.sleep(0.02)
        report = worker.warmup_report
        assert report is not None
        decode_sizes = {shape.tokens for shape in report.shapes if shape.layout == "flat"}
        assert decode_sizes >= set(range(1, MAX_SEQS + 1))
        assert report.sampler_paths == set(SAMPLER_PATHS)
        assert report.resident == ("first", "second")
        # The HTTP warm-up ran text through completions (streamed and not) and chat, on the base and the first adapter.
        calls = worker.http_warmup_calls
        assert calls is not None
        assert {(c.path, c.model, c.stream) for c in calls} == {
            (path, model, stream) for model in (worker.base_model_id, "first")
            for path, stream in (("/v1/completions", False), ("/v1/completions", True), ("/v1/chat/completions", True))}
        assert all(c.status == 200 for c in calls), calls
        # A one-token prompt alone is an eager step of one token, which the warm-up never ran:
        # counted, and exported with its own token count.
        answer = client.post("/v1/completions", json={"model": worker.base_model_id, "prompt": [7], "max_tokens": 2})
        assert answer.status_code == 200, answer.text
        lines = client.get("/metrics").text.splitlines()
        cold = [line for line in lines if line.startswith("loraplex_engine_cold_step_shapes ")]
        assert cold and float(cold[0].split()[1]) >= 1
        assert any(line.startswith('loraplex_engine_cold_step_seconds{kernel_tokens="1",layout="eager",lora="false",'
                                   'step_tokens="1"}') for line in lines), [ln for ln in lines if "cold" in ln]
    print(f"{polls} polls; {report.summary()}")


def test_without_the_warm_up_the_worker_runs_none(tiny_model: Path) -> None:
    worker = Worker(ServerArgs(model=str(tiny_model), device="cpu", max_model_len=128, num_gpu_blocks_override=32,
                               slot_verify_interval=0))  # fmt: skip
    with TestClient(build_app(worker)) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the worker never became ready"
            time.sleep(0.05)
    assert not worker.warms_up and worker.warmup_report is None


def test_the_http_warm_up_leaves_the_chat_route_to_models_with_a_chat_template() -> None:
    """A model without a chat template answers the chat route 400: its warm-up sends none (the
    8B bench model's warm-up logged two refusals)."""
    with_chat = http_warmup_requests("base", ["a0"], 512)
    without = http_warmup_requests("base", ["a0"], 512, chat=False)
    assert [(path, body["model"]) for path, body in with_chat if path.endswith("chat/completions")] == [
        ("/v1/chat/completions", "base"), ("/v1/chat/completions", "a0")]
    assert [path for path, _ in without] == ["/v1/completions"] * 4
