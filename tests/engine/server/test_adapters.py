"""Adapters at run time: load, use, unload and reload in place with new weights while other
requests stream (none fails, the next request sees the new weights); bad adapters are refused with
their reason and the worker keeps serving."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file

from serving.engine import LoRARequest, SamplingParams
from serving.contracts.artifact import base_config_sha256, manifest_write

PROMPT = "Good morning, everyone. Today we will learn"
MAX_TOKENS = 12


def offline_ids(offline, name: str, path: Path) -> list[int]:
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return offline.generate(PROMPT, greedy, LoRARequest(name, str(path)))[0].outputs[0].token_ids


def test_load_use_unload_and_reload_in_place_while_others_stream(worker, offline, make_adapter):
    first = make_adapter(r=8, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), seed=11)
    second = make_adapter(r=8, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), seed=12)
    first_ids, second_ids = offline_ids(offline, "first", first), offline_ids(offline, "second", second)
    assert first_ids != second_ids  # otherwise a stale adapter could pass for the new one
    done = asyncio.Event()
    api = openai.AsyncOpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)
    http = httpx.AsyncClient(base_url=worker.url, timeout=60)

    async def keep_streaming(model: str) -> tuple[int, list[str]]:
        """Streams back to back until the main flow is done; every one must end normally."""
        completed, finishes = 0, []
        while not done.is_set():
            stream = await api.completions.create(model=model, prompt="The river", max_tokens=40, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finishes.append(chunk.choices[0].finish_reason)
            completed += 1
        return completed, finishes

    async def generate(model: str) -> list[int]:
        response = await api.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                                extra_body={"return_token_ids": True})
        return response.choices[0].token_ids

    async def load(name: str, path: Path, inplace: bool = False) -> httpx.Response:
        return await http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path),
                                                              "load_inplace": inplace})

    async def served() -> set[str]:
        return {model.id for model in (await api.models.list()).data}

    async def main_flow() -> None:
        response = await load("dyn", first)
        assert response.status_code == 200, response.text
        assert response.json()["rank"] == 8 and response.json()["kind"] == "lora"
        assert "dyn" in await served()
        assert await generate("dyn") == first_ids

        again = await load("dyn", first)  # same name, same content: nothing to do
        assert again.status_code == 200 and again.json()["digest"] == response.json()["digest"]

        clash = await load("dyn", second)
        assert clash.status_code == 400
        assert "load_inplace" in clash.json()["error"]["message"]
        assert await generate("dyn") == first_ids  # the refused load changed nothing

        replaced = await load("dyn", second, inplace=True)
        assert replaced.status_code == 200, replaced.text
        assert replaced.json()["digest"] != response.json()["digest"]
        assert await generate("dyn") == second_ids

        unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "dyn"})
        assert unloaded.status_code == 200
        assert "dyn" not in await served()
        with pytest.raises(openai.NotFoundError):
            await generate("dyn")
        missing = await http.post("/v1/unload_lora_adapter", json={"lora_name": "dyn"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"

        assert (await load("dyn", first)).status_code == 200
        assert await generate("dyn") == first_ids

    async def run() -> list[tuple[int, list[str]]]:
        streams = [asyncio.create_task(keep_streaming(model)) for model in ("alpha", "beta", "tiny-base")]
        await asyncio.sleep(0.3)  # the streams are running before the first load
        try:
            await main_flow()
        finally:
            done.set()
            results = await asyncio.gather(*streams)
            await http.post("/v1/unload_lora_adapter", json={"lora_name": "dyn"})
            await api.close()
            await http.aclose()
        return results

    for completed, finishes in asyncio.run(run()):
        assert completed >= 1
        assert finishes == ["length"] * completed


def _copy(adapter: Path, where: Path) -> Path:
    return Path(shutil.copytree(adapter, where))


def test_bad_adapters_are_refused_with_their_reason_and_the_worker_keeps_serving(worker, make_adapter, tiny_model,
                                                                                  tmp_path):
    good = make_adapter(r=8, target_modules=("q_proj", "v_proj"), seed=21)
    too_big = make_adapter(r=32, target_modules=("q_proj", "v_proj"), seed=22)

    pickled = _copy(good, tmp_path / "pickled")
    torch.save(load_file(pickled / "adapter_model.safetensors"), pickled / "adapter_model.bin")
    (pickled / "adapter_model.safetensors").unlink()

    corrupt = _copy(good, tmp_path / "corrupt")
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    tampered = _copy(good, tmp_path / "tampered")
    manifest_write(tampered, tenant="alice-co", name="bot", version="1.0.0", base_model_name="tiny-llama",
                   base_config_sha256=base_config_sha256(tiny_model), source_kind="upload", source_id="test")
    other = make_adapter(r=8, target_modules=("q_proj", "v_proj"), seed=23)
    shutil.copy(other / "adapter_model.safetensors", tampered / "adapter_model.safetensors")

    cases = {
        too_big: ["32", "16"],
        pickled: ["adapter_model.bin", "pickle"],
        corrupt: ["safetensors"],
        tampered: ["sha256 mismatch", "adapter_model.safetensors"],
        tmp_path / "nowhere": ["nowhere"],
    }
    failures_before = worker.metric("loraplex_lora_load_failures_total")
    for path, reasons in cases.items():
        response = httpx.post(f"{worker.url}/v1/load_lora_adapter",
                              json={"lora_name": f"bad-{path.name}", "lora_path": str(path)}, timeout=60)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "lora_path"
        for reason in reasons:
            assert reason in error["message"], (reason, error["message"])

    assert worker.metric("loraplex_lora_load_failures_total") >= failures_before + len(cases) - 1
    models = httpx.get(f"{worker.url}/v1/models").json()["data"]
    assert not [m["id"] for m in models if m["id"].startswith("bad-")]
    # ignore_eos: a sampled end-of-text from the random tiny model would end the reply early.
    reply = httpx.post(f"{worker.url}/v1/completions", timeout=60,
                       json={"model": "alpha", "prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
