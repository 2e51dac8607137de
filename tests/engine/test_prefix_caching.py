"""Prefix caching: a prompt's leading full KV blocks computed before for the same adapter (name and
content) or for the base are taken by reference instead of prefilled again. Greedy tokens with
caching on equal caching off and PEFT; a hit never crosses adapters, nor an adapter's reload under
its name; cached blocks are reclaimed under memory pressure, and survive preemption and ``n``
forks with their reference counts right; tensor parallelism computes the same."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from peft_reference import PeftReference, assert_greedy_match
from test_tensor_parallel import ENGINE as TP_ENGINE

from serving.engine import LLM, LoRARequest, SamplingParams
from serving.engine.block_manager import BlockManager
from serving.engine.detokenizer import IncrementalDetokenizer
from serving.engine.sequence import Sequence

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4
# A "system prompt" of 10 full blocks every request shares, then a short question of its own.
SYSTEM = random.Random(7).choices(range(3, 500), k=10 * BLOCK)
QUESTIONS = [[11, 12, 13], [21, 22, 23, 24, 25], [31], [41, 42, 43, 44, 45, 46, 47]]
ENGINE: dict[str, Any] = dict(max_loras=2, max_lora_rank=8, max_num_seqs=8, max_num_batched_tokens=64,
                              max_model_len=128, block_size=BLOCK, num_kv_blocks=128, device="cpu", dtype="float32")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _prompt(question: list[int]) -> dict[str, list[int]]:
    return {"prompt_token_ids": SYSTEM + question}


def _tokens(outputs: list[Any]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, make_adapter: Callable[..., Path]) -> dict[str, Path]:
    return {name: make_adapter(tiny_llama_dir, r=8, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
                               seed=seed, init_scale=0.5)
            for name, seed in (("a", 41), ("b", 42))}  # fmt: skip


@pytest.mark.slow
def test_mixed_adapters_sharing_a_system_prompt_match_caching_off_and_peft(
    tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    loras = [LoRARequest("a", str(adapters["a"])), LoRARequest("b", str(adapters["b"])), None]
    prompts = [_prompt(q) for q in QUESTIONS for _ in loras]
    per_prompt = [lora for _ in QUESTIONS for lora in loras]
    results = {}
    for caching in (False, True):
        llm = LLM(str(tiny_llama_dir), enable_prefix_caching=caching, **ENGINE)
        # A first request per adapter fills the cache; the batch then shares its system prompt.
        llm.generate([_prompt([99])] * 3, GREEDY, lora_request=loras)
        before = llm.llm_engine.stats()
        results[caching] = llm.generate(prompts, GREEDY, lora_request=per_prompt)
        after = llm.llm_engine.stats()
        if caching:
            assert after.prefix_cache_hits - before.prefix_cache_hits == len(prompts) * len(SYSTEM)
            assert all(o.num_cached_tokens == len(SYSTEM) for o in results[caching])
        else:
            assert after.prefix_cache_queries == 0 and all(o.num_cached_tokens is None for o in results[caching])
        assert after.kv_blocks_used == 0
    assert _tokens(results[True]) == _tokens(results[False])

    reference = PeftReference(tiny_llama_dir, adapters)
    for prompt, lora, output in zip(prompts, per_prompt, results[True]):
        name = lora.lora_name if lora else None
        ref = reference.generate(prompt["prompt_token_ids"], name, GREEDY.max_tokens)
        assert_greedy_match(output.outputs[0].token_ids, ref, f"{name} {prompt['prompt_token_ids'][-3:]}")


def test_a_second_request_prefills_only_what_follows_the_cached_blocks(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), **{**ENGINE, "max_loras": 0})
    engine = llm.llm_engine
    first = llm.generate(_prompt(QUESTIONS[1]), GREEDY)[0]
    assert first.num_cached_tokens == 0
    before = engine.stats().prefill_tokens
    second = llm.generate(_prompt(QUESTIONS[3]), GREEDY)[0]
    assert second.num_cached_tokens == len(SYSTEM)
    assert engine.stats().prefill_tokens - before == len(QUESTIONS[3])
    # The same prompt again: every full block hits but the last, whose last token is computed for logits.
    whole = SYSTEM + QUESTIONS[0] + [7]  # 11 full blocks
    llm.generate({"prompt_token_ids": whole}, GREEDY)
    before = engine.stats().prefill_tokens
    again = llm.generate({"prompt_token_ids": whole}, GREEDY)[0]
    assert again.num_cached_tokens == len(whole) - BLOCK
    assert engine.stats().prefill_tokens - before == BLOCK


def test_requests_admitted_in_one_step_share_the_blocks_it_computes(tiny_llama_dir: Path) -> None:
    """The second request's prompt is admitted in the step that prefills the first's (the budget
    holds both): it takes the blocks that step writes, and reads them once written."""
    settings = {**ENGINE, "max_loras": 0}
    llm = LLM(str(tiny_llama_dir), **settings)
    prompts = [_prompt(QUESTIONS[0]), _prompt(QUESTIONS[1])]
    outputs = llm.generate(prompts, GREEDY)
    stats = llm.llm_engine.stats()
    assert stats.steps == GREEDY.max_tokens  # both prefilled in the first step
    assert [o.num_cached_tokens for o in outputs] == [0, len(SYSTEM)]
    assert stats.prefill_tokens == len(SYSTEM) + len(QUESTIONS[0]) + len(QUESTIONS[1])
    off = LLM(str(tiny_llama_dir), **settings, enable_prefix_caching=False)
    assert _tokens(outputs) == _tokens(off.generate(prompts, GREEDY))


def test_the_same_prompt_under_another_adapter_or_the_base_gets_no_hit(
    tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    llm = LLM(str(tiny_llama_dir), **ENGINE)
    a, b = LoRARequest("a", str(adapters["a"])), LoRARequest("b", str(adapters["b"]))
    llm.generate(_prompt(QUESTIONS[0]), GREEDY, lora_request=a)
    for other in (b, None):
        assert llm.generate(_prompt(QUESTIONS[0]), GREEDY, lora_request=other)[0].num_cached_tokens == 0
    assert llm.generate(_prompt(QUESTIONS[0]), GREEDY, lora_request=a)[0].num_cached_tokens == len(SYSTEM)


def test_only_requests_of_one_cache_salt_share(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), **{**ENGINE, "max_loras": 0})
    salted = {**_prompt(QUESTIONS[0]), "cache_salt": "tenant-1"}
    assert llm.generate(salted, GREEDY)[0].num_cached_tokens == 0
    assert llm.generate(_prompt(QUESTIONS[0]), GREEDY)[0].num_cached_tokens == 0  # unsalted: another chain
    assert llm.generate({**salted, "cache_salt": "tenant-2"}, GREEDY)[0].num_cached_tokens == 0
    assert llm.generate(salted, GREEDY)[0].num_cached_tokens == len(SYSTEM)
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate({**salted, "cache_salt": ""}, GREEDY)


def test_an_adapter_reloaded_with_other_weights_under_its_name_gets_no_stale_hit(
    tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    llm = LLM(str(tiny_llama_dir), **ENGINE)
    fresh = LLM(str(tiny_llama_dir), enable_prefix_caching=False, **ENGINE)
    llm.generate(_prompt(QUESTIONS[2]), GREEDY, lora_request=LoRARequest("swap", str(adapters["a"])))
    cache = llm.llm_engine.lora_cache
    assert cache is not None
    old = cache.get("swap")
    assert old is not None
    replaced = llm.llm_engine.add_lora(LoRARequest("swap", str(adapters["b"])), load_inplace=True)
    while not replaced.done():  # the engine's step binds a finished load
        llm.llm_engine.step()
        llm.llm_engine.wait_for_loads(0.1)
    assert replaced.result().digest != old.digest  # one name, other weights
    out = llm.generate(_prompt(QUESTIONS[2]), GREEDY, lora_request=LoRARequest("swap", str(adapters["b"])))[0]
    assert out.num_cached_tokens == 0
    want = fresh.generate(_prompt(QUESTIONS[2]), GREEDY, lora_request=LoRARequest("swap", str(adapters["b"])))[0]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.slow
def test_cached_blocks_are_reclaimed_under_memory_pressure(tiny_llama_dir: Path) -> None:
    """40 blocks hold two requests at a time: most of each batch's prompts evict others' cached
    blocks, and the tokens stay those of an engine without caching."""
    rng = random.Random(3)
    systems = [rng.choices(range(3, 500), k=8 * BLOCK) for _ in range(4)]
    prompts = [{"prompt_token_ids": systems[i % 4] + [50 + i]} for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    settings = {**ENGINE, "max_loras": 0, "num_kv_blocks": 40, "max_num_seqs": 2}
    tight = LLM(str(tiny_llama_dir), **settings)
    roomy = LLM(str(tiny_llama_dir), **{**settings, "num_kv_blocks": 128}, enable_prefix_caching=False)
    assert _tokens(tight.generate(prompts, params)) == _tokens(roomy.generate(prompts, params))
    stats = tight.llm_engine.stats()
    assert stats.prefix_cache_hits > 0
    assert stats.kv_blocks_cached <= 40 and stats.kv_blocks_used == 0
    assert tight.llm_engine.block_manager.num_free_blocks == 40


@pytest.mark.slow
def test_preemption_and_n_forks_with_shared_blocks(tiny_llama_dir: Path, adapters: dict[str, Path]) -> None:
    """Sequences holding cached blocks (n = 3 forks of prompts that hit) are preempted, prefilled
    anew (hitting again) and end with the tokens of an engine without caching; no block leaks."""
    loras = [LoRARequest("a", str(adapters["a"])), None]
    prompts = [_prompt(q) for q in QUESTIONS]
    per_prompt = [loras[i % 2] for i in range(len(prompts))]
    params = SamplingParams(n=3, temperature=0, max_tokens=30, ignore_eos=True)
    settings = {**ENGINE, "num_kv_blocks": 50}
    tight = LLM(str(tiny_llama_dir), **settings)
    tight.generate([_prompt([99])] * 2, GREEDY, lora_request=loras)
    roomy = LLM(str(tiny_llama_dir), **{**settings, "num_kv_blocks": 256}, enable_prefix_caching=False)
    assert _tokens(tight.generate(prompts, params, lora_request=per_prompt)) == _tokens(
        roomy.generate(prompts, params, lora_request=per_prompt))
    stats = tight.llm_engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0


def test_abort_releases_blocks_taken_from_the_cache(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), **{**ENGINE, "max_loras": 0})
    engine = llm.llm_engine
    llm.generate(_prompt([5]), GREEDY)
    engine.add_request("r1", _prompt([6]), GREEDY)
    engine.add_request("r2", _prompt([6]), SamplingParams(n=2, temperature=0, max_tokens=6))
    engine.step()
    assert engine.stats().kv_blocks_used > len(SYSTEM) // BLOCK  # the shared blocks and their own
    engine.abort_request("r1")
    engine.abort_request("r2")
    assert engine.stats().kv_blocks_used == 0
    assert llm.generate(_prompt([6]), GREEDY)[0].num_cached_tokens == len(SYSTEM)


def test_a_failed_step_leaves_no_block_it_was_to_write_in_the_cache(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(str(tiny_llama_dir), **{**ENGINE, "max_loras": 0})
    engine = llm.llm_engine
    execute = engine.runner.execute

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the device failed mid-step")

    monkeypatch.setattr(engine.runner, "execute", fails)
    engine.add_request("lost", _prompt([5]), GREEDY)
    with pytest.raises(RuntimeError, match="mid-step"):
        engine.step()
    engine.abort_request("lost")
    assert engine.stats().kv_blocks_cached == 0
    monkeypatch.setattr(engine.runner, "execute", execute)
    assert llm.generate(_prompt([5]), GREEDY)[0].num_cached_tokens == 0


def test_a_corrupted_adapter_slot_unregisters_the_blocks_its_weights_computed(
    tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    llm = LLM(str(tiny_llama_dir), **ENGINE)
    engine = llm.llm_engine
    a = LoRARequest("a", str(adapters["a"]))
    llm.generate(_prompt([5]), GREEDY, lora_request=a)
    llm.generate(_prompt([5]), GREEDY)  # the base's blocks stay
    cached = engine.stats().kv_blocks_cached
    (info,) = engine.list_loras()
    layer = next(iter(engine.runner.model.lora_layers()))
    with torch.no_grad():
        layer.lora_A[0][info.gpu_row, 0] += 0.25  # a stray write into the adapter's rows
    assert len(engine.verify_slots()) == 1
    assert engine.stats().kv_blocks_cached == cached - len(SYSTEM) // BLOCK  # the adapter's 10, the base's kept
    while engine.stats().adapters_loading:  # the repair's re-read
        engine.wait_for_loads(0.05)
        engine.step()
    assert llm.generate(_prompt([5]), GREEDY, lora_request=a)[0].num_cached_tokens == 0
    assert llm.generate(_prompt([5]), GREEDY)[0].num_cached_tokens == len(SYSTEM)


def _seq(tokens: list[int]) -> Sequence:
    params = SamplingParams()
    return Sequence("r", None, tokens, params, IncrementalDetokenizer(lambda ids: "", tokens, True))


def test_eviction_takes_unregistered_blocks_first_then_the_least_recently_freed() -> None:
    blocks = BlockManager(6, 2, enable_prefix_caching=True)
    old, recent = _seq([1, 2, 3, 4, 5]), _seq([7, 8, 9, 10, 11])
    for seq in (old, recent):
        blocks.take_prefix(seq, blocks.find_prefix(seq))
        blocks.allocate(seq, 5)
        blocks.register_full(seq, 5)
        seq.num_computed_tokens = 5
    assert blocks.num_cached_blocks == 4
    old_head = old.block_table[0]
    blocks.free(old)
    blocks.free(recent)
    assert blocks.num_free_blocks == 6 and blocks.num_cached_blocks == 4
    filler = _seq([0] * 6)
    blocks.allocate(filler, 6)  # the two partial (unregistered) blocks, then old's tail block
    assert blocks.num_cached_blocks == 3
    assert blocks.find_prefix(_seq([1, 2, 3, 4, 5])) == [old_head]
    assert len(blocks.find_prefix(_seq([7, 8, 9, 10, 11]))) == 2


@pytest.mark.e2e
@pytest.mark.usefixtures("tp_ranks_forked")
def test_tensor_parallel_with_caching_equals_one_process(tiny_llama_dir: Path, adapters: dict[str, Path]) -> None:
    """Two ranks over gloo: the step rank 0 broadcasts carries each sequence's block table and
    computed count, so a prefill that starts after cached blocks reads the same KV on both."""
    loras = [LoRARequest("a", str(adapters["a"])), None]
    prompts = [_prompt(q) for q in QUESTIONS[:2] for _ in loras]
    per_prompt = [lora for _ in QUESTIONS[:2] for lora in loras]
    results = []
    for size in (1, 2):
        llm = LLM(str(tiny_llama_dir), **{**TP_ENGINE, "tensor_parallel_size": size})
        try:
            llm.generate([_prompt([99])] * 2, GREEDY, lora_request=loras)
            results.append(llm.generate(prompts, GREEDY, lora_request=per_prompt))
            assert llm.llm_engine.stats().prefix_cache_hits == len(prompts) * len(SYSTEM)
        finally:
            llm.llm_engine.shutdown()
    assert _tokens(results[1]) == _tokens(results[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_on_cuda_caching_equals_caching_off(tiny_llama_dir: Path, adapters: dict[str, Path], eager: bool) -> None:
    """On the GPU (flat steps replayed from CUDA graphs, or eager), prompts that start after cached
    blocks (taken in the same step or later ones) generate what they do without caching."""
    loras = [LoRARequest("a", str(adapters["a"])), LoRARequest("b", str(adapters["b"])), None]
    prompts = [_prompt(q) for q in QUESTIONS for _ in loras]
    per_prompt = [lora for _ in QUESTIONS for lora in loras]
    results = {}
    for caching in (False, True):
        llm = LLM(str(tiny_llama_dir), **{**ENGINE, "device": "cuda", "enforce_eager": eager},
                  enable_prefix_caching=caching)  # fmt: skip
        results[caching] = [_tokens(llm.generate(prompts, GREEDY, lora_request=per_prompt)) for _ in range(2)]
        if caching:
            assert llm.llm_engine.stats().prefix_cache_hits >= (2 * len(prompts) - len(loras)) * len(SYSTEM)
    assert results[True] == results[False]
