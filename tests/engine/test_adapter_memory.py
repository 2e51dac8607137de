"""Adapter memory sized by bytes (docs/adapter-memory.md): more adapters than the GPU pool holds,
of different ranks, served PEFT-exact while they are evicted and copied back mid-stream of other
requests; a rank costs its rows; no request starves when running sequences keep the pool busy.

On CUDA (gpu mark) the same workload runs with CUDA graphs replaying while adapters are copied in
on the copy stream: a request admitted before its adapter's copy landed, or a replay reading rows
being rewritten, would show as a token mismatch against PEFT.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft_reference import PeftReference, assert_greedy_match

from serving.engine import LLM, LoRARequest, SamplingParams

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPECS = [(4, ("q_proj", "v_proj")), (16, ALL), (8, ("k_proj", "o_proj")), (16, ("gate_proj", "down_proj")),
         (8, ALL), (12, ("v_proj", "up_proj")), (4, ALL)]  # fmt: skip
WORDS = "The quick brown fox jumps over the lazy dog and then it runs away into the forest".split()
MAX_TOKENS = 10
_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, make_adapter: Callable[..., Path]) -> dict[str, Path]:
    return {f"a{i}": make_adapter(tiny_llama_dir, r=r, lora_alpha=2 * r, target_modules=mods, seed=70 + i,
                                  init_scale=0.5)
            for i, (r, mods) in enumerate(SPECS)}  # fmt: skip


def row_bytes(model: Path, **kwargs: object) -> int:
    """One rank row's bytes for this model, as the engine computes them."""
    llm = LLM(str(model), max_loras=1, max_model_len=64, num_kv_blocks=16, **kwargs)  # type: ignore[arg-type]
    try:
        return llm.llm_engine.runner.lora_row_bytes
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(("device", "enforce_eager"), [
    pytest.param("cpu", True, id="cpu"),
    pytest.param("cuda", False, marks=_CUDA, id="cuda-graphs"),
])  # fmt: skip
@pytest.mark.slow
def test_more_adapters_than_the_pool_holds_are_served_peft_exact(
    request: pytest.FixtureRequest, device: str, enforce_eager: bool, tiny_llama_dir: Path,
    adapters: dict[str, Path],
) -> None:
    engine_args = dict(device=device, dtype="float32", enforce_eager=enforce_eager)
    rows = 24  # room for a rank-16 and a rank-8 adapter, or three rank-8 ones: never all seven
    llm = LLM(str(tiny_llama_dir), max_lora_rank=16, lora_memory_bytes=rows * row_bytes(tiny_llama_dir, **engine_args),
              max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96, block_size=4, num_kv_blocks=64,
              **engine_args)  # type: ignore[arg-type]
    request.addfinalizer(llm.llm_engine.shutdown)
    names = list(adapters)
    prompts = [" ".join(WORDS[: 3 + (i * 5) % 13]) for i in range(16)]
    # Every eighth request has no adapter; the others cycle through all seven (3 is prime to 7), so
    # each adapter is requested and the bounds below count all of them.
    loras: list[LoRARequest | None] = [
        None if i % 8 == 7 else LoRARequest(names[(i * 3) % len(names)], str(adapters[names[(i * 3) % len(names)]]))
        for i in range(len(prompts))
    ]
    assert {lora.lora_name for lora in loras if lora} == set(names)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           lora_request=loras)

    stats = llm.llm_engine.stats()
    assert stats.lora_rows_total == rows and stats.max_loras == rows // 8
    # At most three of the seven fit at once (three slot-table entries): at least four were evicted.
    assert stats.slot_evictions >= len(adapters) - 3 and stats.slot_loads >= len(adapters)
    assert stats.lora_bytes_loaded > 0 and stats.lora_rows_used <= rows
    if device == "cuda":
        assert llm.llm_engine.runner.graphs is not None and llm.llm_engine.runner.graphs.replays > 0
    reference = PeftReference(tiny_llama_dir, adapters)
    tokenizer = llm.get_tokenizer()
    for prompt, lora, output in zip(prompts, loras, outputs):
        ids = tokenizer(prompt).input_ids
        name = lora.lora_name if lora else None
        assert_greedy_match(output.outputs[0].token_ids, reference.generate(ids, name, MAX_TOKENS), f"{name} {prompt!r}")


@pytest.mark.slow
def test_a_rank_costs_its_own_rows(request: pytest.FixtureRequest, tiny_llama_dir: Path,
                                   make_adapter: Callable[..., Path]) -> None:
    """Memory for 2 rank-64 adapters holds 16 rank-8 ones at once."""
    size = row_bytes(tiny_llama_dir, device="cpu")
    llm = LLM(str(tiny_llama_dir), max_lora_rank=64, lora_memory_bytes=128 * size, max_num_seqs=16,
              max_model_len=64, num_kv_blocks=256, device="cpu")
    request.addfinalizer(llm.llm_engine.shutdown)
    small = [make_adapter(tiny_llama_dir, r=8, lora_alpha=8, target_modules=ALL, seed=100 + i) for i in range(16)]
    engine = llm.llm_engine
    for i, path in enumerate(small):
        engine.add_request(f"r{i}", "The quick brown fox", SamplingParams(max_tokens=30, ignore_eos=True),
                           LoRARequest(f"small{i}", str(path)))
    while engine.scheduler.num_running < 16:
        engine.wait_for_loads(0.05)
        engine.step()
    stats = engine.stats()
    assert (stats.lora_rows_used, stats.slot_evictions) == (128, 0), "16 rank-8 adapters run side by side in 128 rows"
    assert sorted(a.gpu_row for a in engine.list_loras()) == list(range(0, 128, 8))


def test_a_request_is_served_while_another_adapter_keeps_the_pool_busy(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    """Adversarial arrivals: a new request for the resident adapter every step, the pool holding
    only it; the other adapter's request still gets in within the stated bound (the aging period
    plus the running sequences' remaining tokens) and is served PEFT-exact."""
    aging, max_tokens = 8, 6
    llm = LLM(str(tiny_llama_dir), max_lora_rank=16, max_loras=1, max_num_seqs=4, max_model_len=64,
              num_kv_blocks=256, device="cpu", dtype="float32", priority_aging_steps=aging)
    request.addfinalizer(llm.llm_engine.shutdown)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    busy, starved = LoRARequest("a1", str(adapters["a1"])), LoRARequest("a4", str(adapters["a4"]))
    engine.add_request("busy-0", "The quick brown fox", params, busy)
    while engine.scheduler.num_running == 0:
        engine.wait_for_loads(0.05)
        engine.step()
    engine.add_request("starved", "over the lazy dog", params, starved)
    finished: dict[str, list[int]] = {}
    for step in range(1, 200):
        engine.add_request(f"busy-{step}", "The quick brown fox", params, busy)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        if "starved" in finished:
            break
        engine.wait_for_loads(0.001)
    assert "starved" in finished, "the other adapter's request never got the pool"
    assert engine.stats().slot_waits >= aging, "it did wait for room while the busy adapter ran"
    assert step <= aging + 2 * max_tokens + 8, f"served after {step} steps, past the bound"
    ids = llm.get_tokenizer()("over the lazy dog").input_ids
    want = PeftReference(tiny_llama_dir, {"a4": adapters["a4"]}).generate(ids, "a4", max_tokens)
    assert_greedy_match(finished["starved"], want, "starved")
