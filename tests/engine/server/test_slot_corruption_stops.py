"""A GPU slot found corrupted while requests decode on it (docs/resilience.md, "Slot integrity"):
each request that already produced tokens from it is stopped before the slot is rewritten, a stream
with an error event and `[DONE]`, a whole reply with 503 `adapter_slot_corrupted`; both count as
`error`, their KV blocks are freed, and the next request is served from the repaired slot with
PEFT's tokens.

The worker runs in this process under uvicorn (`serve_in_process`), so the test can write into a
slot tensor as a stray kernel would while real HTTP streams run on it."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from serving.engine.server.cli import LoRAModule, ServerArgs
from tests.engine.peft_reference import PeftReference, assert_greedy_match
from tests.engine.server.conftest import LONG_TOKENS, serve_in_process

NAME = "slotstop"
PROMPT = [1, 45, 99, 173, 201, 32]


def _metric(url: str, name: str) -> float:
    match = re.search("^" + re.escape(name) + r" (\S+)$", httpx.get(f"{url}/metrics", timeout=10).text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _wait(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_requests_decoding_on_a_corrupted_slot_are_stopped_with_an_error(
    tiny_model: Path, make_adapter: Callable[..., Path]
) -> None:
    path = make_adapter(r=8, target_modules=("q_proj", "v_proj"), seed=63)
    args = ServerArgs(model=str(tiny_model), device="cpu", lora_modules=[LoRAModule(NAME, str(path))], max_loras=2,
                      max_lora_rank=16, max_model_len=2048, num_gpu_blocks_override=512, slot_verify_interval=0)
    long = {"model": NAME, "prompt": PROMPT, "max_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0}
    with serve_in_process(args) as (worker, url), ThreadPoolExecutor(1) as pool:
        assert worker.engine is not None
        engine = worker.engine.engine
        whole = pool.submit(httpx.post, f"{url}/v1/completions", json=long, timeout=120)
        with httpx.stream("POST", f"{url}/v1/completions", json={**long, "stream": True}, timeout=120) as stream:
            assert stream.status_code == 200
            lines = (line for line in stream.iter_lines() if line)
            assert json.loads(next(lines).removeprefix("data: "))["choices"][0]["text"] is not None
            _wait(lambda: len(running := list(engine.scheduler.running)) == 2
                  and all(seq.num_output_tokens > 0 for seq in running), "both requests to decode")
            (info,) = engine.list_loras()
            assert info.gpu_slot is not None and info.gpu_row is not None
            with torch.no_grad():
                next(iter(engine.runner.model.lora_layers())).lora_B[0][info.gpu_row, 0] += 0.5

            reply = httpx.post(f"{url}/v1/verify_lora_slots", timeout=60)
            assert reply.json() == {"repaired": [{"slot": info.gpu_slot, "digest": info.digest, "names": [NAME], "stopped": 2}]}
            rest = list(lines)

        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert error["code"] == "adapter_slot_corrupted" and f"'{NAME}'" in error["message"], error
        assert all("error" not in json.loads(line.removeprefix("data: ")) for line in rest[:-2])

        response = whole.result()
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "adapter_slot_corrupted"
        assert f"'{NAME}'" in response.json()["error"]["message"]

        _wait(lambda: _metric(url, "loraplex_lora_slot_repairs_total") == 1, "the repair")
        assert _metric(url, "loraplex_lora_slot_corruptions_total") == 1
        assert _metric(url, f'loraplex_requests_total{{model="{NAME}",status="error"}}') == 2
        assert _metric(url, "loraplex_num_requests_running") == 0
        assert _metric(url, "loraplex_kv_cache_blocks_used") == 0, "the stopped requests' KV blocks are free"

        want = PeftReference(tiny_model, {NAME: path}).generate(PROMPT, NAME, 12)
        after = httpx.post(f"{url}/v1/completions", json={**long, "max_tokens": 12, "return_token_ids": True},
                           timeout=120)
        assert after.status_code == 200, after.text
        assert_greedy_match(after.json()["choices"][0]["token_ids"], want, "after the repair")
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
