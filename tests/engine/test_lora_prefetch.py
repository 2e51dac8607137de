"""Prefetching adapters ahead of their traffic (docs/resilience.md, "Predictive prewarm"),
on the engine.

A prefetch puts an adapter in the CPU cache and, where a GPU slot is empty or idle, in a slot; it
never takes a slot that a running sequence pins or that a waiting request needs. The hit and stall
counters it is judged by are checked here too.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest

from serving.engine import LLM, AdapterError, AsyncEngine, LoRARequest, SamplingParams
from serving.engine.llm_engine import LLMEngine
from serving.engine.lora.cache import Placement

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
ARGS = dict(max_cpu_loras=4, max_lora_rank=16, max_model_len=64, num_kv_blocks=64, device="cpu", base_model_name="tiny-llama")


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, make_adapter: Callable[..., Path]) -> dict[str, Path]:
    return {
        "a": make_adapter(tiny_llama_dir, r=8, lora_alpha=16, seed=31, init_scale=0.5),
        "b": make_adapter(tiny_llama_dir, r=8, lora_alpha=16, seed=32, init_scale=0.5),
        "c": make_adapter(tiny_llama_dir, r=8, lora_alpha=16, seed=33, init_scale=0.5),
    }


def _settle(engine: LLMEngine, future: Future[Placement]) -> Placement:
    """Run steps until ``future`` (a prefetch) is done; its result."""
    while not future.done():
        engine.step()
        engine.wait_for_loads(0.05)
    return future.result()


def _slot_names(engine: LLMEngine) -> list[str | None]:
    return list(engine.stats().gpu_slots)


def test_a_prefetched_adapter_is_a_slot_hit_and_serves_the_same_tokens(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    reference = LLM(str(tiny_llama_dir), max_loras=1, **ARGS)
    request.addfinalizer(reference.llm_engine.shutdown)
    want = reference.generate("Good morning", GREEDY, lora_request=LoRARequest("a", str(adapters["a"])))[0]
    # The reference read "a" on demand. Whether its request also waited a step for that read
    # (a stall) is a race with the reader thread, which a loaded machine can win; the read and the
    # slot miss are not.
    assert (reference.llm_engine.stats().slot_misses, reference.llm_engine.stats().adapter_loads) == (1, 1)

    llm = LLM(str(tiny_llama_dir), max_loras=1, **ARGS)
    request.addfinalizer(llm.llm_engine.shutdown)
    engine = llm.llm_engine
    assert _settle(engine, engine.prefetch_lora(LoRARequest("a", str(adapters["a"])), to_gpu=True)) == "gpu"
    assert _slot_names(engine) == ["a"]
    got = llm.generate("Good morning", GREEDY, lora_request=LoRARequest("a"))[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    stats = engine.stats()
    assert (stats.slot_hits, stats.slot_misses, stats.adapter_load_stalls) == (1, 0, 0)
    loads = stats.adapter_loads
    # Prefetching what is already resident reads nothing again.
    assert _settle(engine, engine.prefetch_lora(LoRARequest("a", str(adapters["a"])), to_gpu=True)) == "gpu"
    assert engine.stats().adapter_loads == loads
    # To the CPU cache only: no slot is touched.
    assert _settle(engine, engine.prefetch_lora(LoRARequest("b", str(adapters["b"])), to_gpu=False)) == "cpu"
    assert _slot_names(engine) == ["a"] and {i.name: i.in_cpu_cache for i in engine.list_loras()} == {"a": True, "b": True}


def test_a_prefetch_never_evicts_a_pinned_or_busy_slot_but_takes_an_idle_one(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    llm = LLM(str(tiny_llama_dir), max_loras=1, max_num_seqs=1, **ARGS)
    request.addfinalizer(llm.llm_engine.shutdown)
    engine = llm.llm_engine
    a, b = LoRARequest("a", str(adapters["a"])), LoRARequest("b", str(adapters["b"]))
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    # "b" read into the CPU cache first, so each placement below is decided at once: a storage read
    # under load could outlast the 30 tokens of the sequence that holds the slot.
    assert _settle(engine, engine.prefetch_lora(b, to_gpu=False)) == "cpu"
    # Pinned: a running sequence of "a" holds the only slot.
    engine.add_request("pinned", "Hello there", long, a)
    while _slot_names(engine) != ["a"] or engine.stats().num_running != 1:
        engine.step()
        engine.wait_for_loads(0.05)
    assert _settle(engine, engine.prefetch_lora(b, to_gpu=True)) == "cpu"
    assert _slot_names(engine) == ["a"]
    engine.abort_request("pinned")

    # Busy: "a" runs nothing, but a request for it waits (the only sequence slot is taken by a
    # base-model request), so its slot is kept for it.
    engine.add_request("base", "Hello there", long)
    engine.step()
    engine.add_request("waiting", "Good morning", GREEDY, LoRARequest("a"))
    engine.step()
    assert engine.stats().num_waiting == 1 and engine.stats().num_running == 1
    assert _settle(engine, engine.prefetch_lora(b, to_gpu=True)) == "cpu"
    assert _slot_names(engine) == ["a"]
    engine.abort_request("waiting")

    # Idle: nobody runs or waits for "a": the prefetch takes its slot.
    assert _settle(engine, engine.prefetch_lora(b, to_gpu=True)) == "gpu"
    assert _slot_names(engine) == ["b"]
    engine.abort_request("base")


def test_a_prefetch_does_not_evict_what_the_same_round_keeps(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    llm = LLM(str(tiny_llama_dir), max_loras=2, **ARGS)
    request.addfinalizer(llm.llm_engine.shutdown)
    engine = llm.llm_engine
    a, b, c = (LoRARequest(name, str(adapters[name])) for name in ("a", "b", "c"))
    assert _settle(engine, engine.prefetch_lora(a, to_gpu=True)) == "gpu"
    assert _settle(engine, engine.prefetch_lora(b, to_gpu=True)) == "gpu"
    # "a" is the least recently used slot, so plain LRU would give it to "c"; the round keeps it.
    assert _settle(engine, engine.prefetch_lora(c, to_gpu=True, keep={"a", "c"})) == "gpu"
    assert sorted(n for n in _slot_names(engine) if n) == ["a", "c"]
    # Every idle slot kept: the version waits in the CPU cache rather than evict one.
    assert _settle(engine, engine.prefetch_lora(b, to_gpu=True, keep={"a", "b", "c"})) == "cpu"
    assert sorted(n for n in _slot_names(engine) if n) == ["a", "c"]
    assert {i.name: i.in_cpu_cache for i in engine.list_loras()}["b"]


def test_a_prefetched_adapter_pushed_out_of_its_slot_comes_back_without_a_read(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    llm = LLM(str(tiny_llama_dir), max_loras=1, **{**ARGS, "max_cpu_loras": 2})
    request.addfinalizer(llm.llm_engine.shutdown)
    engine = llm.llm_engine
    a, b = LoRARequest("a", str(adapters["a"])), LoRARequest("b", str(adapters["b"]))
    assert _settle(engine, engine.prefetch_lora(b, to_gpu=False)) == "cpu"
    assert _settle(engine, engine.prefetch_lora(a, to_gpu=True)) == "gpu"
    # An on-demand request for "c" needs a CPU entry (the cache is full: "b", "a") and the slot.
    # The prefetched "a" kept its CPU copy as the newest, so "b" goes, not "a".
    llm.generate("Good morning", GREEDY, lora_request=LoRARequest("c", str(adapters["c"])))
    assert _slot_names(engine) == ["c"]
    assert {i.name: i.in_cpu_cache for i in engine.list_loras()} == {"a": True, "b": False, "c": True}
    loads = engine.stats().adapter_loads
    assert _settle(engine, engine.prefetch_lora(a, to_gpu=True)) == "gpu"
    assert engine.stats().adapter_loads == loads


def test_prefetch_reads_never_hold_up_a_request_waiting_for_its_adapter(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    llm = LLM(str(tiny_llama_dir), max_loras=1, **ARGS)
    request.addfinalizer(llm.llm_engine.shutdown)
    engine = llm.llm_engine
    assert engine.lora_cache is not None
    read, gate, threads = engine.lora_cache.load_fn, threading.Event(), {}

    def storage(path: str, *args: object, **kwargs: object) -> object:  # a loader thread
        threads[Path(path).name] = threading.current_thread().name
        if path != str(adapters["c"]):
            gate.wait(30)  # the prefetches' storage answers only when the test says
        return read(path, *args, **kwargs)

    engine.lora_cache.load_fn = storage
    held = [engine.prefetch_lora(LoRARequest(name, str(adapters[name])), to_gpu=False) for name in ("a", "b")]
    # Two prefetch reads under way would have taken both request loader threads; the request for
    # "c" is served while they wait.
    out = llm.generate("Good morning", GREEDY, lora_request=LoRARequest("c", str(adapters["c"])))[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens and not gate.is_set()
    assert threads[adapters["c"].name].startswith("lora-load")
    assert threads[adapters["a"].name].startswith("lora-prefetch")
    gate.set()
    assert [_settle(engine, future) for future in held] == ["cpu", "cpu"]
    assert threads[adapters["b"].name].startswith("lora-prefetch")


def test_a_prefetch_does_not_replace_what_a_name_serves(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    llm = LLM(str(tiny_llama_dir), max_loras=1, **ARGS)
    request.addfinalizer(llm.llm_engine.shutdown)
    engine = llm.llm_engine
    _settle(engine, engine.prefetch_lora(LoRARequest("a", str(adapters["a"])), to_gpu=False))
    with pytest.raises(AdapterError, match="a prefetch does not replace it"):
        engine.prefetch_lora(LoRARequest("a", str(adapters["b"])), to_gpu=True)
    (info,) = engine.list_loras()
    assert info.path == str(adapters["a"])


def test_async_prefetch_reports_where_the_adapter_ended(tiny_llama_dir: Path, adapters: dict[str, Path]) -> None:
    engine = AsyncEngine.from_args(str(tiny_llama_dir), max_loras=1, **ARGS)
    try:
        async def run() -> tuple[str, str]:
            first = await engine.prefetch_lora(LoRARequest("a", str(adapters["a"])), to_gpu=True)
            second = await engine.prefetch_lora(LoRARequest("b", str(adapters["b"])), to_gpu=False)
            return first, second

        assert asyncio.run(run()) == ("gpu", "cpu")
        stats = asyncio.run(engine.get_stats())
        assert stats.gpu_slots == ("a",) and stats.adapter_loads == 2
    finally:
        engine.shutdown()


def test_listing_named_adapters_describes_only_those_loaded_in_the_order_asked(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    # What a prefetch call and a load's description use, instead of an entry for every adapter.
    llm = LLM(str(tiny_llama_dir), max_loras=1, **ARGS)
    request.addfinalizer(llm.llm_engine.shutdown)
    engine = llm.llm_engine
    assert _settle(engine, engine.prefetch_lora(LoRARequest("b", str(adapters["b"])), to_gpu=True)) == "gpu"
    assert _settle(engine, engine.prefetch_lora(LoRARequest("a", str(adapters["a"])), to_gpu=False)) == "cpu"
    everything = {info.name: info for info in engine.list_loras()}
    assert list(everything) == ["a", "b"]
    named = engine.list_loras(["b", "missing", "a"])
    assert named == [everything["b"], everything["a"]], "the loaded ones of the names, as asked, same entries"
    assert named[0].gpu_slot is not None and named[1].gpu_slot is None and named[1].in_cpu_cache
    assert engine.list_loras([]) == [] and engine.list_loras(["missing"]) == []
