"""ProcessEngine: the engine core in a spawned child process, behind AsyncEngine's face.

Real processes on the tiny CPU model. AsyncEngine on the same settings is the reference: the same
greedy tokens and text, the same errors with the same messages. Then what only a process has:
the child killed under open streams, and shutdown leaving no process behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from serving.engine import (
    AdapterError,
    AdapterNotFoundError,
    AsyncEngine,
    EngineConfig,
    EngineDeadError,
    LoRARequest,
    RequestOutput,
    SamplingParams,
)
from serving.engine.distributed.parallel import RankFailedError
from serving.engine.engine_client import EngineClient
from serving.engine.engine_messages import AddRequest
from serving.engine.process_engine import ProcessEngine
from tests.engine.test_async_engine import ENGINE_ARGS, GREEDY

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_thread", "engine_core_forked")]


@pytest.fixture(scope="module")
def config(tiny_llama_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(tiny_llama_dir), **ENGINE_ARGS)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def adapter(tiny_llama_dir: Path, make_adapter: Callable[..., Path]) -> Path:
    return make_adapter(tiny_llama_dir, r=8, lora_alpha=16, target_modules=("q_proj", "v_proj"), seed=1,
                        init_scale=0.5)


@pytest.fixture(scope="module")
def engine(config: EngineConfig) -> Iterator[ProcessEngine]:
    engine = ProcessEngine(config)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(config: EngineConfig) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(config)
    yield engine
    engine.shutdown()


async def _collect(engine: EngineClient, prompt: str, params: SamplingParams, rid: str,
                   lora: LoRARequest | None = None) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, rid, lora_request=lora)]


def test_same_tokens_and_text_as_the_thread_engine(engine: ProcessEngine, reference: AsyncEngine,
                                                   adapter: Path) -> None:
    lora = LoRARequest("a", str(adapter))
    cases = [("The quick brown fox", None), ("Hello! How are you today?", lora), ("Once upon a time", None),
             ("Once upon a time", lora)]

    async def run(on: EngineClient, tag: str) -> list[list[RequestOutput]]:
        return await asyncio.gather(*(_collect(on, p, GREEDY, f"{tag}-{i}", l) for i, (p, l) in enumerate(cases)))

    got, want = asyncio.run(run(engine, "proc")), asyncio.run(run(reference, "thread"))
    for streamed, expected in zip(got, want):
        assert streamed[-1].finished and all(not out.finished for out in streamed[:-1])
        final, reference_final = streamed[-1].outputs[0], expected[-1].outputs[0]
        assert (final.token_ids, final.text) == (reference_final.token_ids, reference_final.text)
        assert final.finish_reason == "length"
    assert got[3][-1].outputs[0].token_ids != got[2][-1].outputs[0].token_ids  # the adapter changes them
    assert (engine.model_name, engine.max_model_len, engine.vocab_size) == (
        reference.model_name, reference.max_model_len, reference.vocab_size)


def _shape(streamed: list[RequestOutput]) -> list[Any]:
    """Everything a stream's final output says, and that every output before extends into it."""
    final = streamed[-1]
    for out in streamed[:-1]:
        for before, after in zip(out.outputs, final.outputs):
            assert after.token_ids[: len(before.token_ids)] == before.token_ids
            assert after.text.startswith(before.text)
    floats: list[float] = []
    exact = [final.prompt, final.prompt_token_ids, _rounded(final.prompt_logprobs, floats), final.num_cached_tokens,
             [(c.index, c.text, c.token_ids, _rounded(c.cumulative_logprob, floats), _rounded(c.logprobs, floats),
               c.finish_reason, c.stop_reason) for c in final.outputs]]
    return [exact, floats]


def _rounded(value: object, floats: list[float] | None = None) -> object:
    """``value`` with its log-probabilities taken out into ``floats`` (compared approximately: the
    child's torch runs on its own thread count, so sums may differ in their last bits, the tokens
    may not)."""
    if isinstance(value, float) and floats is not None:
        floats.append(value)
        return "float"
    if isinstance(value, list):
        return [_rounded(item, floats) for item in value]
    if isinstance(value, dict):
        return {key: (_rounded(v.logprob, floats), v.rank, v.decoded_token) for key, v in value.items()}
    return value


def test_every_output_field_crosses_the_pipe(engine: ProcessEngine, reference: AsyncEngine) -> None:
    """n, best_of, logprobs, prompt logprobs, seeds and stop strings: the rebuilt outputs (deltas
    made cumulative again) say what the thread engine's say."""
    prompt = "A field guide to the stars"
    # Both engines hold the prompt in their prefix caches from here, so each request below finds
    # the same cached blocks; one at a time, so no batch differs between them either.
    probes = [asyncio.run(_collect(on, prompt, GREEDY, "probe"))[-1].outputs[0].text for on in (engine, reference)]
    assert probes[0] == probes[1]
    stop = probes[0][3:5]
    cases = [
        SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=12, logprobs=2),
        SamplingParams(temperature=0.8, seed=5, n=2, best_of=3, max_tokens=8),
        SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=stop),
    ]

    async def run(on: EngineClient) -> list[list[object]]:
        return [_shape(await _collect(on, prompt, params, f"fields-{i}")) for i, params in enumerate(cases)]

    got, want = asyncio.run(run(engine)), asyncio.run(run(reference))
    assert [exact for exact, _ in got] == [exact for exact, _ in want]
    for (_, floats), (_, reference_floats) in zip(got, want):
        assert floats == pytest.approx(reference_floats, abs=1e-3)


def test_abort_ends_the_stream_with_abort(engine: ProcessEngine) -> None:
    async def run() -> tuple[RequestOutput, list[RequestOutput], int]:
        stream = engine.generate("Hello there", LONG, "to-abort")
        first = await stream.__anext__()
        await engine.abort("to-abort")
        rest = [out async for out in stream]
        return first, rest, (await engine.get_stats()).kv_blocks_used

    first, rest, kv_blocks_used = asyncio.run(run())
    assert not first.finished
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert len(rest[-1].outputs[0].token_ids) < LONG.max_tokens
    assert kv_blocks_used == 0


def test_leaving_the_stream_early_aborts_in_the_child(engine: ProcessEngine) -> None:
    async def run() -> tuple[int, int]:
        stream = engine.generate("Hello there", LONG, "leaves")
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 2:
                break
        running = (await engine.get_stats()).num_running
        await stream.aclose()  # what a server does when its client goes away
        for _ in range(200):
            stats = await engine.get_stats()
            if stats.num_running == 0:
                break
            await asyncio.sleep(0.01)
        return running, stats.num_running + stats.kv_blocks_used

    running_before, left = asyncio.run(run())
    assert running_before == 1 and left == 0


def test_a_bad_prompt_fails_before_the_pipe(engine: ProcessEngine, reference: AsyncEngine) -> None:
    bad = {"prompt_token_ids": [1, 2, 10**9]}

    async def error(on: EngineClient) -> str:
        with pytest.raises(ValueError) as raised:
            await _collect(on, bad, GREEDY, "bad-prompt")  # type: ignore[arg-type]
        return str(raised.value)

    sent: list[tuple[object, ...]] = []
    send = engine._send

    def spy(message: tuple[object, ...]) -> None:
        sent.append(message)
        send(message)

    engine._send = spy  # type: ignore[method-assign]
    try:
        message = asyncio.run(error(engine))
    finally:
        del engine._send
    assert message == asyncio.run(error(reference)) and "outside the vocabulary" in message
    assert sent == []


def test_adapter_errors_cross_with_their_type_and_message(engine: ProcessEngine, reference: AsyncEngine,
                                                          tmp_path: Path) -> None:
    nowhere = LoRARequest("nowhere", str(tmp_path / "does-not-exist"))

    async def errors(on: EngineClient) -> tuple[BaseException, BaseException, BaseException]:
        with pytest.raises(AdapterError) as by_add:
            await on.add_lora(nowhere)
        with pytest.raises(AdapterError) as by_request:
            await _collect(on, "Hello", GREEDY, "bad-adapter", LoRARequest("nowhere-2", nowhere.lora_path))
        with pytest.raises(AdapterNotFoundError) as by_remove:
            await on.remove_lora("never-loaded")
        return by_add.value, by_request.value, by_remove.value

    got, want = asyncio.run(errors(engine)), asyncio.run(errors(reference))
    assert [(type(e), str(e)) for e in got] == [(type(e), str(e)) for e in want]
    assert "does not exist" in str(got[0])


def test_adapter_add_list_prefetch_and_remove(engine: ProcessEngine, adapter: Path) -> None:
    async def run() -> tuple[object, ...]:
        info = await engine.add_lora(LoRARequest("loaded", str(adapter)))
        placement = await engine.prefetch_lora(LoRARequest("loaded", str(adapter)), to_gpu=True)
        names = [i.name for i in await engine.list_loras(["loaded", "absent"])]
        await engine.remove_lora("loaded")
        return info, placement, names, [i.name for i in await engine.list_loras()], await engine.verify_slots()

    info, placement, names, after, repairs = asyncio.run(run())
    assert (info.name, info.rank, info.path) == ("loaded", 8, str(adapter))  # type: ignore[attr-defined]
    assert placement == "gpu" and names == ["loaded"] and "loaded" not in after and repairs == []


def test_shutdown_aborts_streams_and_leaves_no_process(config: EngineConfig) -> None:
    engine = ProcessEngine(config)
    child = psutil.Process(engine.pid)
    family = [child, *child.children(recursive=True)]
    # A terminal's Ctrl-C, a service manager's SIGTERM to every process: the engine waits for its owner.
    child.send_signal(signal.SIGINT)
    child.send_signal(signal.SIGTERM)

    async def run() -> RequestOutput:
        assert len((await _collect(engine, "Hello", GREEDY, "after-signals"))[-1].outputs[0].token_ids) == 10
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
        stream = engine.generate("Hello there", LONG, "at-shutdown")
        await stream.__anext__()
        await asyncio.to_thread(engine.shutdown)  # as the worker calls it, its loop still running
        return [out async for out in stream][-1]

    last = asyncio.run(run())
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert not engine.is_running
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in family)
    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(engine.get_stats())
    engine.shutdown()  # a second call does nothing


def test_a_killed_child_fails_open_streams_and_later_calls(config: EngineConfig) -> None:
    deaths: list[Exception] = []
    engine = ProcessEngine(config, on_dead=deaths.append)

    async def run() -> BaseException:
        stream = engine.generate("Hello there", LONG, "killed-under")
        await stream.__anext__()
        assert engine.pid is not None
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError) as raised:
            async for _ in stream:
                pass
        return raised.value

    try:
        error = asyncio.run(run())
        assert "exit code -9" in str(error)
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            asyncio.run(engine.get_stats())
        with pytest.raises(EngineDeadError):
            asyncio.run(_collect(engine, "Hello", GREEDY, "after-death"))
    finally:
        engine.shutdown()  # joins the reader thread, the only one that tells of a death
    assert len(deaths) == 1 and isinstance(deaths[0], EngineDeadError)


def test_a_dead_tensor_parallel_rank_ends_the_process_engine_as_the_thread_engine(tiny_llama_dir: Path) -> None:
    """A rank of the child's tensor-parallel group killed: the step fails with RankFailedError in the
    child, which fails its requests and says so; the parent stops running and tells its owner once."""
    config = EngineConfig(model=str(tiny_llama_dir), **{**ENGINE_ARGS, "max_loras": 0,  # type: ignore[arg-type]
                                                          "tensor_parallel_size": 2, "dtype": "float32"})
    deaths: list[Exception] = []
    engine = ProcessEngine(config, on_dead=deaths.append)
    child = psutil.Process(engine.pid)
    family = [child, *child.children(recursive=True)]
    ranks = [p for p in child.children() if "rank_worker" in " ".join(p.cmdline())]
    try:
        assert len(ranks) == 1
        assert len(asyncio.run(_collect(engine, "Hello", GREEDY, "before"))[-1].outputs[0].token_ids) == 10
        ranks[0].kill()
        with pytest.raises(EngineDeadError, match="tensor-parallel rank 1"):
            asyncio.run(_collect(engine, "Hello", GREEDY, "after"))
        assert not engine.is_running
        with pytest.raises(EngineDeadError, match="tensor-parallel rank 1"):
            asyncio.run(engine.get_stats())
    finally:
        engine.shutdown()
    assert len(deaths) == 1 and isinstance(deaths[0], RankFailedError)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in family)


def test_a_cache_salt_crosses_with_the_encoded_prompt(engine: ProcessEngine) -> None:
    ids = list(range(10, 30))  # five full KV blocks of 4

    async def cached(salt: str, rid: str) -> int | None:
        prompt = {"prompt_token_ids": ids, "cache_salt": salt}
        return [out async for out in engine.generate(prompt, GREEDY, rid)][-1].num_cached_tokens

    async def run() -> list[int | None]:
        return [await cached("tenant-1", "salt-1"), await cached("tenant-1", "salt-2"),
                await cached("tenant-2", "salt-3")]

    sent: list[tuple[object, ...]] = []
    send = engine._send

    def spy(message: tuple[Any, ...]) -> None:
        sent.append(message)
        send(message)

    engine._send = spy  # type: ignore[method-assign]
    try:
        first, again, other = asyncio.run(run())
    finally:
        del engine._send
    assert first == 0 and again is not None and again > 0 and other == 0
    # It crosses as the command's salt, beside the token ids, and nothing else of the prompt.
    adds = [command for _, command in sent if isinstance(command, AddRequest)]
    assert [(add.cache_salt, add.encoded) for add in adds] == [
        ("tenant-1", (None, ids)), ("tenant-1", (None, ids)), ("tenant-2", (None, ids))]
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        asyncio.run(cached("", "salt-bad"))
