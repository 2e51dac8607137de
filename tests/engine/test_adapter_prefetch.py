"""The scheduler's adapter look-ahead and resident-first admission (docs/adapter-memory.md, "Admission";
``EngineConfig.lora_prefetch_groups``), on the engine with the tiny model.

- Look-ahead: a waiting request's adapter is copied into the GPU pool (on CUDA: its copy started,
  resident or filling) before the request is admitted when it is on, and not when it is off; its
  admission then counts as a prefetch hit. An adapter whose CPU copy is gone is read again ahead.
- It never evicts an adapter a running sequence or a waiting request uses; it takes an idle one.
- Greedy tokens are the same with it on and off.
- Admission: a step admits the requests of resident adapters before it starts any copy, so a copy
  does not evict the adapter of requests waiting behind it; a request needing a copy that has a
  better aged level is not passed over.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from peft_reference import PeftReference, assert_greedy_match

from serving.engine import LLM, LoRARequest, SamplingParams
from serving.engine.llm_engine import LLMEngine
from serving.engine.lora.cache import Placement
from serving.engine.server.metrics import ServerMetrics

pytestmark = pytest.mark.usefixtures("one_thread")

_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", marks=_CUDA, id="cuda")]
ARGS: dict[str, Any] = dict(max_lora_rank=16, max_model_len=64, num_kv_blocks=64, base_model_name="tiny-llama")
MAX_TOKENS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, make_adapter: Callable[..., Path]) -> dict[str, Path]:
    return {name: make_adapter(tiny_llama_dir, r=8, lora_alpha=16, seed=90 + i, init_scale=0.5)
            for i, name in enumerate("abcd")}  # fmt: skip


def _engine(request: pytest.FixtureRequest, model: Path, **kwargs: Any) -> LLMEngine:
    llm = LLM(str(model), **{**ARGS, "device": "cpu", **kwargs})
    request.addfinalizer(llm.llm_engine.shutdown)
    return llm.llm_engine


def _settle(engine: LLMEngine, future: Future[Placement]) -> Placement:
    while not future.done():
        engine.step()
        engine.wait_for_loads(0.05)
    return future.result()


def _put(engine: LLMEngine, adapters: dict[str, Path], names: str, *, to_gpu: bool) -> None:
    """Load ``names`` into the CPU cache and, with ``to_gpu``, into slots."""
    for name in names:
        assert _settle(engine, engine.prefetch_lora(LoRARequest(name, str(adapters[name])), to_gpu=to_gpu)) == (
            "gpu" if to_gpu else "cpu")


def _slot(engine: LLMEngine, name: str) -> int | None:
    return engine.list_loras([name])[0].gpu_slot


def _running(engine: LLMEngine) -> list[str]:
    return sorted(seq.request_id for seq in engine.scheduler.running)


def _drain(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        engine.wait_for_loads(0.001)
    return tokens


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("groups", [2, 0], ids=["on", "off"])
def test_a_waiting_requests_adapter_is_copied_in_before_its_admission(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, adapters: dict[str, Path], device: str, groups: int
) -> None:
    engine = _engine(request, tiny_llama_dir, max_loras=2, max_num_seqs=1, device=device,
                     lora_prefetch_groups=groups)
    _put(engine, adapters, "b", to_gpu=False)
    _put(engine, adapters, "a", to_gpu=True)  # so "first" is admitted at once on CUDA too, a slot hit
    engine.add_request("first", "Hello there", GREEDY, LoRARequest("a"))
    engine.add_request("second", "Good morning", GREEDY, LoRARequest("b"))
    engine.step()
    assert _running(engine) == ["first"] and engine.scheduler.num_waiting == 1
    stats = engine.stats()
    if groups:
        # Started behind the admitted request's copy: landed on CPU, landed or filling on CUDA.
        assert _slot(engine, "b") is not None and stats.lora_prefetches == 1
    else:
        assert _slot(engine, "b") is None and stats.lora_prefetches == 0
    _drain(engine)
    stats = engine.stats()
    # "second" found its adapter resident when the look-ahead had put it there: a hit, not a miss.
    assert (stats.slot_misses, stats.slot_hits, stats.lora_prefetch_hits) == ((0, 2, 1) if groups else (1, 1, 0))
    metrics = ServerMetrics().render(stats, None).decode().splitlines()
    assert f"loraplex_lora_prefetches_total {float(bool(groups))}" in metrics
    assert f"loraplex_lora_prefetch_hits_total {float(bool(groups))}" in metrics


def test_a_waiting_requests_adapter_whose_cpu_copy_is_gone_is_read_ahead(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    engine = _engine(request, tiny_llama_dir, max_loras=1, max_num_seqs=1, max_cpu_loras=2)
    _put(engine, adapters, "ab", to_gpu=False)
    engine.add_request("first", "Hello there", LONG, LoRARequest("a"))
    engine.step()
    assert _running(engine) == ["first"]
    # Two more into the CPU cache of two push "a" (its slot serves it) and then "b" (unused) out.
    _put(engine, adapters, "cd", to_gpu=False)
    assert not engine.list_loras(["b"])[0].in_cpu_cache
    loads = engine.stats().adapter_loads
    engine.add_request("second", "Good morning", GREEDY, LoRARequest("b"))
    engine.step()  # "second" waits for the only sequence place; the look-ahead starts its read
    assert engine.stats().lora_prefetches == 1
    while not engine.list_loras(["b"])[0].in_cpu_cache:
        assert _running(engine) == ["first"], "read ahead while 'first' still runs"
        engine.wait_for_loads(5.0)  # returns once the read is in
        engine.step()
    assert engine.stats().adapter_loads == loads + 1
    tokens = _drain(engine)
    assert set(tokens) == {"first", "second"} and engine.stats().adapter_load_stalls == 0


def test_the_look_ahead_never_evicts_an_adapter_in_use_but_takes_an_idle_one(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    engine = _engine(request, tiny_llama_dir, max_loras=2, max_num_seqs=1)
    _put(engine, adapters, "c", to_gpu=False)
    _put(engine, adapters, "ab", to_gpu=True)
    engine.add_request("running", "Hello there", LONG, LoRARequest("a"))
    engine.step()
    assert _running(engine) == ["running"]
    # Both slots are in use: "a" by a running sequence, "b" by a waiting request; "c" waits too.
    engine.add_request("waiting-b", "Good morning", LONG, LoRARequest("b"))
    engine.add_request("waiting-c", "Good evening", GREEDY, LoRARequest("c"))
    for _ in range(3):
        engine.step()
        assert (_slot(engine, "a"), _slot(engine, "b"), _slot(engine, "c")) == (0, 1, None)
    assert engine.stats().lora_prefetches == 0 and engine.stats().slot_evictions == 0
    # "b" idle (its request gone, its name kept): the look-ahead gives its slot to "c".
    engine.abort_request("waiting-b")
    engine.step()
    assert (_slot(engine, "a"), _slot(engine, "b"), _slot(engine, "c")) == (0, None, 1)
    assert _running(engine) == ["running"] and engine.stats().lora_prefetches == 1
    engine.abort_request("running")
    _drain(engine)
    assert engine.stats().lora_prefetch_hits == 1


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_tokens_are_the_same_with_the_look_ahead_on_and_off(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, adapters: dict[str, Path], device: str
) -> None:
    """Four adapters over three slots, two sequence places: requests wait behind others while their
    adapters are copied in (on) or not (off)."""
    names = "abcdbadc"
    prompts = ["The quick brown fox", "Good morning", "over the lazy dog", "Hello there"] * 2
    runs = []
    for groups in (2, 0):
        engine = _engine(request, tiny_llama_dir, max_loras=3, max_num_seqs=2, device=device,
                         dtype="float32", lora_prefetch_groups=groups)
        _put(engine, adapters, "abcd", to_gpu=False)
        for i, (name, prompt) in enumerate(zip(names, prompts)):
            engine.add_request(f"r{i}", prompt, GREEDY, LoRARequest(name))
        runs.append((_drain(engine), engine.stats()))
    (on, on_stats), (off, off_stats) = runs
    assert len(on) == len(off) == len(names)
    if device == "cpu":
        assert on == off
    else:  # the runs batch differently: a near-tie may part them, as it may part either from PEFT
        reference, tokenizer = PeftReference(tiny_llama_dir, adapters), engine.tokenizer
        for i, (name, prompt) in enumerate(zip(names, prompts)):
            want = reference.generate(tokenizer(prompt).input_ids, name, MAX_TOKENS)
            assert_greedy_match(on[f"r{i}"], want, f"on r{i}")
            assert_greedy_match(off[f"r{i}"], want, f"off r{i}")
    assert on_stats.lora_prefetch_hits > 0 and off_stats.lora_prefetches == 0


@pytest.mark.parametrize("resident_priority", [0, 1], ids=["same-level", "lower-priority"])
def test_resident_adapters_requests_are_admitted_before_a_copy_starts(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, adapters: dict[str, Path], resident_priority: int
) -> None:
    """One slot, holding "a"; "b" in the CPU cache. A request for "b" arrives first, then two for "a",
    in one step. Of one level, "a"'s are admitted and "b"'s copy waits (before, "b" was admitted first
    and its copy evicted "a", whose requests then waited for the slot). A "b" request of a better
    priority is not passed over: it is admitted, evicting "a", as before."""
    engine = _engine(request, tiny_llama_dir, max_loras=1, max_num_seqs=4)
    _put(engine, adapters, "b", to_gpu=False)
    _put(engine, adapters, "a", to_gpu=True)
    engine.add_request("b", "Good morning", GREEDY, LoRARequest("b"))
    engine.add_request("a1", "Hello there", GREEDY, LoRARequest("a"), priority=resident_priority)
    engine.add_request("a2", "The quick brown fox", GREEDY, LoRARequest("a"), priority=resident_priority)
    engine.step()
    stats = engine.stats()
    if resident_priority == 0:
        assert _running(engine) == ["a1", "a2"] and _slot(engine, "a") == 0
        assert (stats.slot_misses, stats.slot_evictions) == (0, 0)
    else:
        assert _running(engine) == ["b"] and _slot(engine, "b") == 0
        assert (stats.slot_misses, stats.slot_evictions) == (1, 1)
    assert set(_drain(engine)) == {"a1", "a2", "b"}


def test_a_request_needing_a_copy_is_passed_over_for_at_most_an_aging_period(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    """One sequence place, one slot holding "a"; a request for "b" and four for "a" arrive in one step
    (one level). "a"'s go first while "b"'s has waited no longer than an aging period (4 steps: "a0"
    ends in step 3, "a1" is admitted in step 4); then "b" is next, not behind all of "a"'s (the
    look-ahead off: it would find no idle slot anyway)."""
    engine = _engine(request, tiny_llama_dir, max_loras=1, max_num_seqs=1, priority_aging_steps=4,
                     lora_prefetch_groups=0)
    _put(engine, adapters, "b", to_gpu=False)
    _put(engine, adapters, "a", to_gpu=True)
    engine.add_request("b", "Good morning", GREEDY, LoRARequest("b"))
    for i in range(4):
        engine.add_request(f"a{i}", "Hello there", GREEDY, LoRARequest("a"))
    order: list[str] = []
    while engine.has_unfinished_requests():
        order += [out.request_id for out in engine.step() if out.finished]
    assert order == ["a0", "a1", "b", "a2", "a3"]
