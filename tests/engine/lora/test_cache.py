"""The adapter cache's promise on unload: an idle adapter's GPU slot, CPU copy and memory are freed.

vLLM breaks this one (its issue #42207: unloading leaves the memory held), so it is checked on the
cache's own state, by digest: once the name is gone a slot's label is the digest, so a check by
name could not see a slot that was kept.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest

from serving.engine import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def _cpu_copy_bytes(llm: LLM) -> int:
    cache = llm.llm_engine.lora_cache
    assert cache is not None
    return sum(t.nbytes for a in cache.cpu_resident() if a.weights for pair in a.weights.values() for t in pair)


def test_unloading_an_idle_adapter_frees_its_slot_cpu_copy_and_memory(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, make_adapter: Callable[..., Path]
) -> None:
    adapter = make_adapter(tiny_llama_dir, r=8, lora_alpha=16, seed=21, init_scale=0.5)
    llm = LLM(str(tiny_llama_dir), max_loras=2, max_lora_rank=16, device="cpu", max_model_len=64, num_kv_blocks=64)
    request.addfinalizer(llm.llm_engine.shutdown)
    cache = llm.llm_engine.lora_cache
    assert cache is not None
    before = _cpu_copy_bytes(llm)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate("Hello there", params, lora_request=LoRARequest("idle", str(adapter)))

    (info,) = llm.llm_engine.list_loras()
    assert info.name == "idle" and info.active_requests == 0, "the adapter is loaded and idle"
    resident = cache.slots()[info.gpu_slot]
    assert resident is not None and resident.digest == info.digest and resident.weights is not None
    assert info.digest in [a.digest for a in cache.cpu_resident()] and _cpu_copy_bytes(llm) > before
    copies = [weakref.ref(t) for pair in resident.weights.values() for t in pair]
    del resident

    llm.llm_engine.remove_lora("idle")
    gc.collect()

    assert llm.llm_engine.list_loras() == []
    assert cache.slots() == [None, None], "the slot it held is empty again"
    assert info.digest not in [a.digest for a in cache.cpu_resident()], "its CPU copy is gone"
    stats = llm.llm_engine.stats()
    assert not any(stats.gpu_slots) and not any(info.digest.startswith(label) for label in stats.cpu_cached)
    assert _cpu_copy_bytes(llm) == before, "the cache holds no more adapter memory than before the load"
    assert all(ref() is None for ref in copies), "nothing else keeps the CPU copy's tensors alive"
