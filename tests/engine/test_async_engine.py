"""AsyncEngine: streaming, abort and disconnect, adapter add / remove / replace, adapter errors.

One engine serves the whole module (as the HTTP server holds one); each test runs its own event
loop. The offline LLM on the same model is the reference for what a request must produce.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from serving.engine import (
    LLM,
    AdapterError,
    AdapterNotFoundError,
    AsyncEngine,
    LoRARequest,
    RequestOutput,
    SamplingParams,
)
from serving.contracts.artifact import base_config_sha256, manifest_write

ENGINE_ARGS = dict(
    max_loras=2,
    max_cpu_loras=2,
    max_lora_rank=64,
    max_num_seqs=8,
    max_model_len=256,
    block_size=4,
    num_kv_blocks=128,
    device="cpu",
    base_model_name="tiny-llama",
)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, make_adapter: Callable[..., Path]) -> dict[str, Path]:
    return {
        "a": make_adapter(tiny_llama_dir, r=8, lora_alpha=16, target_modules=("q_proj", "v_proj"), seed=1, init_scale=0.5),
        "b": make_adapter(tiny_llama_dir, r=16, lora_alpha=32, target_modules=("o_proj", "down_proj"), seed=2, init_scale=0.5),
    }


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[AsyncEngine]:
    engine = AsyncEngine.from_args(str(tiny_llama_dir), **ENGINE_ARGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), **ENGINE_ARGS)


async def _collect(engine: AsyncEngine, prompt: str, params: SamplingParams, rid: str, lora=None) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, rid, lora_request=lora)]


def test_streaming_equals_offline(engine: AsyncEngine, offline: LLM, adapters: dict[str, Path]) -> None:
    cases = [
        ("The quick brown fox", GREEDY, None),
        ("Hello! How are you today?", GREEDY, LoRARequest("a", str(adapters["a"]))),
        ("Once upon a time", SamplingParams(temperature=0.8, seed=7, max_tokens=12), LoRARequest("b", str(adapters["b"]))),
    ]
    expected = [offline.generate(p, s, lora_request=l)[0].outputs[0] for p, s, l in cases]

    async def run() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(_collect(engine, p, s, f"stream-{i}", l) for i, (p, s, l) in enumerate(cases)))

    for streamed, want in zip(asyncio.run(run()), expected):
        final = streamed[-1].outputs[0]
        assert streamed[-1].finished and all(not o.finished for o in streamed[:-1])
        assert final.token_ids == want.token_ids and final.text == want.text
        for out in streamed:
            assert final.token_ids[: len(out.outputs[0].token_ids)] == out.outputs[0].token_ids
            assert final.text.startswith(out.outputs[0].text)


def test_streamed_text_never_shows_a_stop_string(engine: AsyncEngine, offline: LLM) -> None:
    full = offline.generate("The quick brown fox", GREEDY)[0].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=stop)
    streamed = asyncio.run(_collect(engine, "The quick brown fox", params, "stop-stream"))
    assert streamed[-1].outputs[0].text == full[: full.index(stop)]
    assert all(stop not in out.outputs[0].text for out in streamed)


async def _idle_stats(engine: AsyncEngine):
    stats = await engine.get_stats()
    return stats, {info.name: info for info in await engine.list_loras()}


def test_abort_frees_kv_blocks_and_adapter_refs(engine: AsyncEngine, adapters: dict[str, Path]) -> None:
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def run():
        stream = engine.generate("Hello there", long, "to-abort", lora_request=LoRARequest("a", str(adapters["a"])))
        first = await stream.__anext__()
        busy, _ = await _idle_stats(engine)
        await engine.abort("to-abort")
        rest = [out async for out in stream]
        return first, busy, rest, await _idle_stats(engine)

    first, busy, rest, (stats, loras) = asyncio.run(run())
    assert not first.finished and busy.kv_blocks_used > 0
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert len(rest[-1].outputs[0].token_ids) < 200
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert loras["a"].active_requests == 0


def test_client_disconnect_aborts(engine: AsyncEngine) -> None:
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def run():
        stream = engine.generate("Hello there", long, "disconnects")
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 2:
                break
        await stream.aclose()  # what a server does when its client goes away
        for _ in range(100):
            stats = await engine.get_stats()
            if stats.num_running == 0:
                break
            await asyncio.sleep(0.01)
        return stats

    stats = asyncio.run(run())
    assert stats.num_running == 0 and stats.kv_blocks_used == 0


def test_duplicate_request_id_is_refused(engine: AsyncEngine) -> None:
    async def run():
        first = engine.generate("Hello", SamplingParams(max_tokens=50, ignore_eos=True), "dup")
        await first.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await _collect(engine, "Hello", GREEDY, "dup")
        await first.aclose()

    asyncio.run(run())


@pytest.mark.slow
def test_add_replace_and_remove(engine: AsyncEngine, offline: LLM, adapters: dict[str, Path]) -> None:
    prompt = "The weather this morning"
    with_a = offline.generate(prompt, GREEDY, LoRARequest("a", str(adapters["a"])))[0].outputs[0].token_ids
    with_b = offline.generate(prompt, GREEDY, LoRARequest("b", str(adapters["b"])))[0].outputs[0].token_ids
    assert with_a != with_b

    async def run():
        info = await engine.add_lora(LoRARequest("swap", str(adapters["a"])))
        assert (info.name, info.rank, info.path) == ("swap", 8, str(adapters["a"]))
        assert info.in_cpu_cache and len(info.digest) == 64
        first = (await _collect(engine, prompt, GREEDY, "swap-1", LoRARequest("swap")))[-1]
        with pytest.raises(AdapterError, match="already loaded with different content"):
            await engine.add_lora(LoRARequest("swap", str(adapters["b"])))
        again = await engine.add_lora(LoRARequest("swap", str(adapters["a"])))  # same content: a no-op
        assert again.digest == info.digest
        replaced = await engine.add_lora(LoRARequest("swap", str(adapters["b"])), load_inplace=True)
        assert replaced.digest != info.digest
        second = (await _collect(engine, prompt, GREEDY, "swap-2", LoRARequest("swap")))[-1]
        await engine.remove_lora("swap")
        names = [i.name for i in await engine.list_loras()]
        with pytest.raises(AdapterNotFoundError, match="'swap' is not loaded"):
            await _collect(engine, prompt, GREEDY, "swap-3", LoRARequest("swap"))
        with pytest.raises(AdapterNotFoundError):
            await engine.remove_lora("swap")
        return first, second, names

    first, second, names = asyncio.run(run())
    assert first.outputs[0].token_ids == with_a
    assert second.outputs[0].token_ids == with_b
    assert "swap" not in names


def test_remove_lets_in_flight_requests_finish_then_frees(
    engine: AsyncEngine, offline: LLM, adapters: dict[str, Path]
) -> None:
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = offline.generate("Good morning", params, LoRARequest("b", str(adapters["b"])))[0].outputs[0].token_ids

    async def run():
        await engine.add_lora(LoRARequest("leaving", str(adapters["b"])))
        stream = engine.generate("Good morning", params, "leaving-1", lora_request=LoRARequest("leaving"))
        await stream.__anext__()
        await engine.remove_lora("leaving")
        outs = [out async for out in stream]
        return outs[-1], await engine.get_stats()

    final, stats = asyncio.run(run())
    assert final.outputs[0].token_ids == want
    assert "leaving" not in stats.gpu_slots and "leaving" not in stats.cpu_cached
    assert all(info.name != "leaving" for info in stats.adapters)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def bad_adapters(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path, make_adapter: Callable[..., Path], adapters: dict[str, Path]
) -> dict[str, tuple[Path, str]]:
    """Broken adapters, each with a phrase its error message must contain."""
    root = tmp_path_factory.mktemp("bad")
    good = adapters["a"]
    cases: dict[str, tuple[Path, str]] = {
        "rank": (make_adapter(tiny_llama_dir, r=128, lora_alpha=16, seed=3), "rank 128 exceeds max_lora_rank 64"),
        "base": (
            make_adapter(tiny_llama_dir, r=4, lora_alpha=8, seed=5, base_model_name_or_path="org/other-model"),
            "other-model",
        ),
    }
    shape = _copy(good, root / "shape")
    tensors = load_file(shape / "adapter_model.safetensors")
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0] + 3, tensors[key].shape[1])
    save_file(tensors, shape / "adapter_model.safetensors")
    cases["shape"] = (shape, "has shape")
    module = _copy(good, root / "module")
    config = json.loads((module / "adapter_config.json").read_text())
    (module / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["norm"]}))
    cases["module"] = (module, "modules_to_save (norm) is not supported")
    missing = _copy(good, root / "missing")
    (missing / "adapter_model.safetensors").unlink()
    cases["missing"] = (missing, "missing")
    corrupt = _copy(good, root / "corrupt")
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    cases["corrupt"] = (corrupt, "safetensors")
    digest = _copy(good, root / "digest")
    manifest_write(
        digest,
        tenant="t",
        name="a",
        version="1.0.0",
        base_model_name="tiny-llama",
        base_config_sha256=base_config_sha256(tiny_llama_dir),
        source_kind="upload",
        source_id=1,
    )
    with open(digest / "adapter_model.safetensors", "r+b") as handle:
        handle.seek(-4, 2)
        handle.write(b"\x00\x00\x80\x7f")
    cases["digest"] = (digest, "sha256")
    cases["nowhere"] = (root / "does-not-exist", "does not exist")
    return cases


@pytest.mark.parametrize("case", ["rank", "module", "shape", "missing", "corrupt", "digest", "base", "nowhere"])
def test_adapter_errors_are_clear_and_the_engine_keeps_serving(
    case: str, engine: AsyncEngine, offline: LLM, bad_adapters: dict[str, tuple[Path, str]], adapters: dict[str, Path]
) -> None:
    path, phrase = bad_adapters[case]
    want = offline.generate("Good morning", GREEDY, LoRARequest("a", str(adapters["a"])))[0].outputs[0].token_ids

    async def run():
        with pytest.raises(AdapterError) as by_add:
            await engine.add_lora(LoRARequest(f"bad-{case}", str(path)))
        good = asyncio.create_task(_collect(engine, "Good morning", GREEDY, f"good-{case}", LoRARequest("a", str(adapters["a"]))))
        with pytest.raises(AdapterError) as by_request:
            await _collect(engine, "Hello", GREEDY, f"bad-req-{case}", LoRARequest(f"bad2-{case}", str(path)))
        return by_add.value, by_request.value, await good, await engine.get_stats()

    by_add, by_request, good, stats = asyncio.run(run())
    assert phrase in str(by_add), str(by_add)
    assert str(by_request) == str(by_add)
    assert good[-1].outputs[0].token_ids == want
    assert stats.adapter_load_failures >= 2 and stats.num_waiting == 0 and stats.num_running == 0
