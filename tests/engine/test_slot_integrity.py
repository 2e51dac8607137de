"""Slot integrity (issue #12, seed §8.2): a GPU slot changed in place is detected and repaired.

The test writes into a slot tensor as a stray kernel would, sees ``verify_slots`` name the slot,
and sees the slot rewritten from storage, after which the adapter gives PEFT's tokens again.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft_reference import PeftReference, assert_greedy_match

from serving.engine import LLM, LoRARequest, SamplingParams
from serving.engine.slot_integrity import SlotChecksums

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = "The quick brown fox jumps"


def test_a_slot_written_in_place_is_detected_and_repaired_from_storage(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, make_adapter: Callable[..., Path]
) -> None:
    path = make_adapter(tiny_llama_dir, r=8, lora_alpha=16, target_modules=("q_proj", "v_proj"), seed=41,
                        init_scale=0.5)
    llm = LLM(str(tiny_llama_dir), max_loras=2, max_cpu_loras=2, max_lora_rank=16, device="cpu", max_model_len=64,
              num_kv_blocks=64)
    request.addfinalizer(llm.llm_engine.shutdown)
    engine = llm.llm_engine
    prompt_ids = llm.get_tokenizer()(PROMPT).input_ids
    want = PeftReference(tiny_llama_dir, {"tuned": path}).generate(prompt_ids, "tuned", GREEDY.max_tokens or 0)

    first = llm.generate({"prompt_token_ids": prompt_ids}, GREEDY, lora_request=LoRARequest("tuned", str(path)))[0]
    assert_greedy_match(first.outputs[0].token_ids, want, "before")
    assert engine.verify_slots() == [], "a slot as written passes"
    (info,) = engine.list_loras()
    assert info.gpu_slot is not None
    slot = info.gpu_slot

    # A stray write into the slot: one element of one layer's A, in place.
    layer = next(iter(engine.runner.model.lora_layers()))
    with torch.no_grad():
        layer.lora_A[0][slot, 0, 0] += 0.25
    loads = engine.stats().adapter_loads

    (repair,) = engine.verify_slots()
    assert (repair.slot, repair.digest, repair.names) == (slot, info.digest, ("tuned",))
    while engine.stats().adapters_loading:  # the re-read from storage runs on a loader thread
        engine.wait_for_loads(0.05)
        engine.step()
    stats = engine.stats()
    assert stats.adapter_loads == loads + 1, "the slot was refilled from storage, not from the CPU copy"
    assert (stats.slot_checks, stats.slot_corruptions, stats.slot_repairs) == (2, 1, 1)
    assert engine.verify_slots() == [], "the repaired slot sums as written"
    assert engine.list_loras()[0].gpu_slot == slot

    again = llm.generate({"prompt_token_ids": prompt_ids}, GREEDY, lora_request=LoRARequest("tuned"))[0]
    assert_greedy_match(again.outputs[0].token_ids, want, "after the repair")


def test_a_pinned_slot_is_rewritten_in_place(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, make_adapter: Callable[..., Path]
) -> None:
    """A slot a running sequence pins cannot be emptied: it is rewritten where it is once the
    re-read is in, and the sequence's later steps run on the repaired weights."""
    path = make_adapter(tiny_llama_dir, r=8, lora_alpha=16, seed=42, init_scale=0.5)
    llm = LLM(str(tiny_llama_dir), max_loras=1, max_cpu_loras=2, max_lora_rank=16, device="cpu", max_model_len=64,
              num_kv_blocks=64)
    request.addfinalizer(llm.llm_engine.shutdown)
    engine = llm.llm_engine
    engine.add_request("long", PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                       LoRARequest("tuned", str(path)))
    while engine.stats().num_running != 1:
        engine.step()
        engine.wait_for_loads(0.05)
    with torch.no_grad():
        next(iter(engine.runner.model.lora_layers())).lora_B[0][0, 1, 1] += 1.0
    (repair,) = engine.verify_slots()
    assert repair.slot == 0 and engine.list_loras()[0].gpu_slot == 0, "the pinned slot keeps its adapter"
    while engine.stats().slot_repairs == 0:
        engine.wait_for_loads(0.05)
        engine.step()
    assert engine.verify_slots() == [] and engine.list_loras()[0].gpu_slot == 0
    while engine.has_unfinished_requests():
        engine.step()


def test_an_unchanged_slot_passes_every_check(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, make_adapter: Callable[..., Path]
) -> None:
    """Rewrites of a slot by other adapters (smaller ranks, other modules) record their own sums."""
    paths = [make_adapter(tiny_llama_dir, r=r, lora_alpha=16, target_modules=mods, seed=50 + r, init_scale=0.5)
             for r, mods in ((16, ("q_proj", "k_proj", "v_proj", "o_proj")), (4, ("down_proj",)))]
    llm = LLM(str(tiny_llama_dir), max_loras=1, max_cpu_loras=2, max_lora_rank=16, device="cpu", max_model_len=64,
              num_kv_blocks=64)
    request.addfinalizer(llm.llm_engine.shutdown)
    for i, path in enumerate([*paths, paths[0]]):
        llm.generate(PROMPT, GREEDY, lora_request=LoRARequest(f"a{i % 2}", str(path)))
        assert llm.llm_engine.verify_slots() == []
    assert llm.llm_engine.stats().slot_corruptions == 0


_DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                               reason="needs a CUDA device")]),
]


@pytest.mark.parametrize("device", _DEVICES)
def test_a_one_bit_change_is_seen_and_recording_never_synchronises(device: str) -> None:
    """The sum is over bits: flipping the lowest bit of one bf16 element (a change a float sum would
    round away) is seen in that slot only. On CUDA, recording runs under sync-debug "error"."""
    tensors = [torch.randn(4, 16, 64, dtype=torch.bfloat16, device=device) * 100,
               torch.rand(4, device=device), torch.arange(4, dtype=torch.int32, device=device)]
    sums = SlotChecksums(tensors, num_slots=4)
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        for slot in range(4):
            sums.record(slot)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert sums.mismatched([0, 1, 2, 3]) == []
    bits = tensors[0].view(torch.int16)
    bits[2, 3, 5] ^= 1
    assert sums.mismatched([0, 1, 2, 3]) == [2]
    assert sums.mismatched([0, 1, 3]) == [], "only occupied slots are judged"
