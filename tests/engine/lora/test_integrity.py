"""Slot integrity (docs/resilience.md, "Slot integrity"): a GPU slot changed in place is detected
and repaired.

The test writes into a slot tensor as a stray kernel would, sees ``verify_slots`` name the slot,
and sees the slot rewritten from storage, after which the adapter gives PEFT's tokens again.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft_reference import PeftReference, assert_greedy_match

from serving.engine import LLM, LoRARequest, RequestOutput, SamplingParams
from serving.engine.lora.integrity import SlotChecksums, SlotCorruptedError, raw_sum

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
    assert info.gpu_slot is not None and info.gpu_row is not None
    slot = info.gpu_slot

    # A stray write into the adapter's rows: one element of one layer's A, in place.
    layer = next(iter(engine.runner.model.lora_layers()))
    with torch.no_grad():
        layer.lora_A[0][info.gpu_row, 0] += 0.25
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


def test_what_runs_on_a_corrupted_slot_is_stopped_before_the_slot_is_rewritten(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, make_adapter: Callable[..., Path]
) -> None:
    """A sequence that produced tokens on a slot found corrupted ends with SlotCorruptedError and
    frees its KV blocks; one still in its prefill, and one still waiting, have produced nothing and
    are served whole from the repaired slot, as a later request is: PEFT's tokens each time."""
    path = make_adapter(tiny_llama_dir, r=8, lora_alpha=16, seed=42, init_scale=0.5)
    llm = LLM(str(tiny_llama_dir), max_loras=1, max_cpu_loras=2, max_lora_rank=16, device="cpu", max_model_len=64,
              num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=4)
    request.addfinalizer(llm.llm_engine.shutdown)
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    prompts = {rid: tokenizer(text).input_ids for rid, text in (
        ("decoding", PROMPT), ("prefilling", "Once upon a time there was a little girl who lived in a village near"),
        ("waiting", "The capital of France is"))}
    peft = PeftReference(tiny_llama_dir, {"tuned": path})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = {rid: peft.generate(ids, "tuned", params.max_tokens or 0) for rid, ids in prompts.items()}
    lora = LoRARequest("tuned", str(path))

    engine.add_request("decoding", {"prompt_token_ids": prompts["decoding"]}, params, lora)
    outputs: dict[str, RequestOutput] = {}

    def step() -> None:
        for output in engine.step():
            outputs[output.request_id] = output
        engine.wait_for_loads(0.01)

    while "decoding" not in outputs or len(outputs["decoding"].outputs[0].token_ids) < 2:
        step()
    # A prompt longer than a step's budget (4 tokens) is prefilled over several steps; the one
    # after it cannot run (max_num_seqs=2) and waits.
    engine.add_request("prefilling", {"prompt_token_ids": prompts["prefilling"]}, params, lora)
    engine.add_request("waiting", {"prompt_token_ids": prompts["waiting"]}, params, lora)
    step()
    running = {seq.request_id: seq for seq in engine.scheduler.running}
    assert set(running) == {"decoding", "prefilling"} and running["prefilling"].num_output_tokens == 0
    assert 0 < running["prefilling"].num_computed_tokens < len(prompts["prefilling"])
    emitted = len(outputs["decoding"].outputs[0].token_ids)

    with torch.no_grad():
        next(iter(engine.runner.model.lora_layers())).lora_B[0][engine.list_loras()[0].gpu_row + 1, 1] += 1.0
    (repair,) = engine.verify_slots()
    assert (repair.slot, repair.names, repair.stopped) == (0, ("tuned",), 1)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 2, 0), \
        "nothing runs on the slot and the stopped sequences' KV blocks are free, before the next step"
    assert engine.list_loras()[0].gpu_slot is None, "the slot is empty until the re-read is in"

    step()
    stopped = outputs["decoding"]
    assert stopped.finished and stopped.outputs[0].finish_reason == "error"
    assert isinstance(stopped.error, SlotCorruptedError) and "'tuned'" in str(stopped.error)
    assert len(stopped.outputs[0].token_ids) == emitted, "not one more token from the corrupted slot"
    assert set(engine.request_ids()) == {"prefilling", "waiting"}

    while engine.has_unfinished_requests():
        step()
    for rid in ("prefilling", "waiting"):
        assert outputs[rid].error is None and outputs[rid].outputs[0].finish_reason == "length"
        assert_greedy_match(outputs[rid].outputs[0].token_ids, want[rid], f"{rid}, served after the repair")
    stats = engine.stats()
    assert (stats.slot_corruptions, stats.slot_repairs, stats.num_preemptions) == (1, 1, 1)
    assert stats.kv_blocks_used == 0 and engine.verify_slots() == []
    again = llm.generate({"prompt_token_ids": prompts["decoding"]}, params, lora_request=LoRARequest("tuned"))[0]
    assert_greedy_match(again.outputs[0].token_ids, want["decoding"], "a later request")


def test_a_sequence_waiting_again_after_a_preemption_is_stopped_too(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, make_adapter: Callable[..., Path]
) -> None:
    """A preempted sequence holds no slot, but the tokens it waits to resume from came from it."""
    path = make_adapter(tiny_llama_dir, r=8, lora_alpha=16, seed=43, init_scale=0.5)
    llm = LLM(str(tiny_llama_dir), max_loras=1, max_cpu_loras=2, max_lora_rank=16, device="cpu", max_model_len=64,
              num_kv_blocks=64)
    request.addfinalizer(llm.llm_engine.shutdown)
    engine = llm.llm_engine
    engine.add_request("resumed", PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                       LoRARequest("tuned", str(path)))
    while not engine.scheduler.running or engine.scheduler.running[0].num_output_tokens < 2:
        engine.step()
        engine.wait_for_loads(0.01)
    (seq,) = engine.scheduler.running
    engine.scheduler.requeue(seq)  # what a preemption under KV pressure leaves: waiting, with its tokens
    with torch.no_grad():
        next(iter(engine.runner.model.lora_layers())).lora_A[0][engine.list_loras()[0].gpu_row + 2, 3] -= 1.0
    (repair,) = engine.verify_slots()
    assert repair.stopped == 1
    (output,) = engine.step()
    assert isinstance(output.error, SlotCorruptedError) and output.outputs[0].finish_reason == "error"
    assert not engine.has_unfinished_requests() and engine.stats().kv_blocks_used == 0


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
def test_a_one_bit_change_is_seen_in_its_adapters_rows_and_recording_never_synchronises(device: str) -> None:
    """The sum is over bits: flipping the lowest bit of one bf16 element (a change a float sum would
    round away) is seen in the adapter whose rows hold it, and only there. Expected sums come from
    the CPU copies (``raw_sum``), so on CUDA recording runs under sync-debug "error"."""
    pools = [torch.zeros(32, 64, dtype=torch.bfloat16, device=device), torch.zeros(32, 8, dtype=torch.bfloat16, device=device)]
    scaling = torch.zeros(4, device=device)
    ranks = torch.zeros(4, dtype=torch.int32, device=device)
    rows = torch.zeros(4, dtype=torch.int32, device=device)
    sums = SlotChecksums(pools, scaling, ranks, rows)
    placed = [(0, 0, 8), (1, 20, 4), (2, 8, 12)]  # (slot, first row, rank): not in row order
    for slot, row, rank in placed:
        content = [torch.randn(rank, t.shape[1], dtype=torch.bfloat16) * 100 for t in pools]
        for pool, part in zip(pools, content):
            pool[row:row + rank] = part.to(device)
        scaling[slot], ranks[slot], rows[slot] = 0.5 * (slot + 1), rank, row
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            sums.record(slot, content=sum(raw_sum(part) for part in content), scaling=0.5 * (slot + 1), rank=rank,
                        row=row)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    assert sums.mismatched(placed) == []
    pools[1].view(torch.int16)[10, 5] ^= 1  # row 10 is slot 2's (rows 8..19)
    assert sums.mismatched(placed) == [2]
    assert sums.mismatched(placed[:2]) == [], "only the adapters named are judged"
    pools[1].view(torch.int16)[10, 5] ^= 1
    pools[0][30, 0] = 1.0  # a free row: no adapter reads it
    assert sums.mismatched(placed) == []
    ranks[1] = 3  # the table entry is checked too
    assert sums.mismatched(placed) == [1]


def test_a_dora_slots_scale_row_written_in_place_is_detected_and_repaired(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, make_adapter: Callable[..., Path]
) -> None:
    """DoRA's scale rows are computed on the device at load; a stray write into one is caught like one
    into the adapter's rows, and the repair computes the row again."""
    path = make_adapter(tiny_llama_dir, r=8, lora_alpha=16, target_modules=("q_proj", "v_proj"), seed=43,
                        init_scale=0.5, use_dora=True)
    llm = LLM(str(tiny_llama_dir), max_loras=2, max_cpu_loras=2, max_lora_rank=16, device="cpu", max_model_len=64,
              num_kv_blocks=64)
    request.addfinalizer(llm.llm_engine.shutdown)
    engine = llm.llm_engine
    llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("tuned", str(path)))
    assert engine.verify_slots() == []
    (info,) = engine.list_loras()
    assert info.gpu_slot is not None
    table = next(iter(engine.runner.model.lora_layers())).dora_scale
    assert table is not None
    written = table[info.gpu_slot + 1].clone()
    with torch.no_grad():
        table[info.gpu_slot + 1, 3] += 0.25

    (repair,) = engine.verify_slots()
    assert (repair.slot, repair.digest) == (info.gpu_slot, info.digest)
    while engine.stats().adapters_loading:
        engine.wait_for_loads(0.05)
        engine.step()
    assert engine.verify_slots() == [], "the repaired slot's scale row sums as written"
    assert torch.equal(table[info.gpu_slot + 1], written)
