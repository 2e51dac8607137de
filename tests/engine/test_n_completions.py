"""Several completions of one prompt (n, best_of): one prefill shared by the request's sequences,
forked with their KV blocks (the partial last block copied on write), each sampling on its own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from serving.engine import LLM, EngineConfig, LoRARequest, SamplingParams
from serving.engine.block_manager import BlockManager
from serving.engine.sampling_params import seed_of
from serving.engine.scheduler import Scheduler
from serving.engine.sequence import Sequence

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    # Blocks of 4: the prompt's last block is partial for most prompt lengths.
    return LLM(str(tiny_llama_dir), max_loras=0, device="cpu", max_model_len=256, num_kv_blocks=128, block_size=4)


def _prompt_ids(llm: LLM, text: str = PROMPT) -> list[int]:
    return list(llm.get_tokenizer()(text).input_ids)


def test_n_costs_one_prefill(llm: LLM) -> None:
    ids = _prompt_ids(llm)
    assert len(ids) % 4 != 0  # the shared last block is partial: the copy-on-write path runs
    engine = llm.llm_engine
    before = engine.stats()
    outs = llm.generate({"prompt_token_ids": ids}, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=12,
                                                                  ignore_eos=True))
    after = engine.stats()
    assert after.prefill_tokens - before.prefill_tokens == len(ids)
    assert after.generation_tokens - before.generation_tokens == 4 * 12
    completions = outs[0].outputs
    assert [c.index for c in completions] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in completions)
    assert len({tuple(c.token_ids) for c in completions}) > 1  # sampled: the sequences differ
    assert after.kv_blocks_used == 0  # every shared block was released once


def test_greedy_n_gives_n_copies_of_n_1(llm: LLM) -> None:
    for text in (PROMPT, "Hello", "Once upon a time there"):  # partial and full last blocks
        greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
        one = llm.generate(text, greedy)[0].outputs[0]
        many = llm.generate(text, SamplingParams(n=3, temperature=0, max_tokens=14, ignore_eos=True))[0].outputs
        assert [c.token_ids for c in many] == [one.token_ids] * 3
        assert [c.text for c in many] == [one.text] * 3


def test_seeded_n_is_reproducible_and_sequence_i_draws_from_seed_i(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.2, seed=77, max_tokens=10, ignore_eos=True)
    first = [c.token_ids for c in llm.generate(PROMPT, params)[0].outputs]
    # In a batch beside other requests, the same three completions.
    batch = llm.generate(["Hello there", PROMPT], [SamplingParams(n=2, temperature=1.0, max_tokens=7), params])
    assert [c.token_ids for c in batch[1].outputs] == first
    # Sequence i is what a request seeded with seed_of(77, i) samples alone; sequence 0 is seed 77's.
    for i, tokens in enumerate(first):
        alone = SamplingParams(temperature=1.2, seed=seed_of(77, i), max_tokens=10, ignore_eos=True)
        assert llm.generate(PROMPT, alone)[0].outputs[0].token_ids == tokens
    assert seed_of(77, 0) == 77 and len({seed_of(77, i) for i in range(50)}) == 50


def test_best_of_returns_the_n_most_likely(llm: LLM) -> None:
    best = SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, logprobs=0)
    chosen = llm.generate(PROMPT, best)[0].outputs
    everything = llm.generate(PROMPT, SamplingParams(n=5, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True,
                                                     logprobs=0))[0].outputs
    ranked = sorted(everything, key=lambda c: -(c.cumulative_logprob or 0.0))
    assert [c.token_ids for c in chosen] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in chosen] == [0, 1]
    for c in chosen:
        assert c.cumulative_logprob == pytest.approx(sum(entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs or [])))
    # Without logprobs asked, the ranking is the same (the chosen tokens' logprobs are computed anyway).
    quiet = SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    assert [c.token_ids for c in llm.generate(PROMPT, quiet)[0].outputs] == [c.token_ids for c in chosen]


def test_n_under_kv_pressure_preempts_and_recomputes(tiny_llama_dir: Path) -> None:
    """Forked sequences preempted (their shared blocks released one reference at a time) and
    prefilled anew still give the greedy tokens."""
    roomy = LLM(str(tiny_llama_dir), max_loras=0, device="cpu", max_model_len=128, num_kv_blocks=256, block_size=4)
    tight = LLM(str(tiny_llama_dir), max_loras=0, device="cpu", max_model_len=128, num_kv_blocks=40, block_size=4)
    prompts = [PROMPT, "Once upon a time there was", "Hello"]
    params = SamplingParams(n=3, temperature=0, max_tokens=30, ignore_eos=True)
    want = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params)]
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params)]
    assert got == want
    assert tight.llm_engine.stats().num_preemptions > 0
    assert tight.llm_engine.stats().kv_blocks_used == 0


def test_n_with_an_adapter_equals_n_1(tiny_llama_dir: Path, make_adapter: Callable[..., Path]) -> None:
    adapter = make_adapter(tiny_llama_dir, r=8, seed=11, init_scale=0.5)
    llm = LLM(str(tiny_llama_dir), max_loras=1, device="cpu", max_model_len=128, num_kv_blocks=64, block_size=4)
    lora = LoRARequest("ad", lora_path=str(adapter))
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    one = llm.generate(PROMPT, greedy, lora)[0].outputs[0].token_ids
    base = llm.generate(PROMPT, greedy)[0].outputs[0].token_ids
    assert one != base
    many = llm.generate([PROMPT, PROMPT], SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True),
                        [lora, None])
    assert [c.token_ids for c in many[0].outputs] == [one, one]
    assert [c.token_ids for c in many[1].outputs] == [base, base]
    info = llm.llm_engine.list_loras()[0]
    assert info.active_requests == 0  # every forked sequence let go of the adapter


def test_abort_ends_every_sequence(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("n-abort", PROMPT, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.stats().num_running == 3
    output = engine.abort_request("n-abort")
    assert output is not None and output.finished and len(output.outputs) == 3
    assert {c.finish_reason for c in output.outputs} == {"abort"}
    assert engine.stats().num_running == 0 and engine.stats().kv_blocks_used == 0


def test_n_beyond_max_num_seqs_is_refused(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), max_loras=0, device="cpu", max_model_len=64, num_kv_blocks=32, max_num_seqs=4)
    with pytest.raises(ValueError, match="best_of/n of 5 sequences exceeds max_num_seqs"):
        llm.generate("Hi", SamplingParams(n=5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_n_on_cuda_prefills_once_and_copies_greedy(tiny_llama_dir: Path, make_adapter: Callable[..., Path],
                                                   eager: bool) -> None:
    """On the GPU (flat steps replayed from CUDA graphs, or eager): the forks' first tokens from
    the shared logits row, the partial block's copy on the device, adapters and base mixed."""
    adapter = make_adapter(tiny_llama_dir, r=8, seed=12, init_scale=0.5)
    llm = LLM(str(tiny_llama_dir), max_loras=1, device="cuda", dtype="float32", max_model_len=128, num_kv_blocks=96,
              block_size=4, enforce_eager=eager)
    lora = LoRARequest("ad", lora_path=str(adapter))
    prompts = [PROMPT, "Hello", "Once upon a time there"]
    loras = [lora, None, lora]
    ones = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                                                 ignore_eos=True), loras)]
    before = llm.llm_engine.stats()
    many = llm.generate(prompts, SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True), loras)
    assert [[c.token_ids for c in o.outputs] for o in many] == [[tokens] * 3 for tokens in ones]
    after = llm.llm_engine.stats()
    # Each prompt once, computed or taken from the prefix cache (the same prompts ran just before).
    computed = after.prefill_tokens - before.prefill_tokens + after.prefix_cache_hits - before.prefix_cache_hits
    assert computed == sum(len(_prompt_ids(llm, p)) for p in prompts)
    seeded = SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=12, ignore_eos=True)
    first = [c.token_ids for c in llm.generate(PROMPT, seeded, lora)[0].outputs]
    assert [c.token_ids for c in llm.generate(PROMPT, seeded, lora)[0].outputs] == first
    assert len({tuple(t) for t in first}) > 1


def test_admission_keeps_places_for_forks_to_come(tmp_path: Path) -> None:
    """A request of n = 3 still in its prefill holds three of max_num_seqs, so its forks never push
    the batch past it."""
    scheduler = Scheduler(EngineConfig(model=str(tmp_path), max_loras=0, block_size=4, max_num_seqs=4,
                                       max_num_batched_tokens=12), BlockManager(64, 4), None)

    def seq(name: str, prompt_len: int, forks: int = 0) -> Sequence:
        return Sequence(request_id=name, prompt=None, prompt_token_ids=list(range(1, prompt_len + 1)),
                        sampling_params=SamplingParams(n=forks + 1), num_forks=forks,
                        detokenizer=None)  # type: ignore[arg-type]  # the scheduler never decodes text

    wide = seq("wide", 20, forks=2)
    scheduler.add(wide)
    assert scheduler.schedule().scheduled == [(wide, 12)]  # its first chunk: admitted, the prompt not done
    wide.num_computed_tokens = 12
    for i in range(3):
        scheduler.add(seq(f"one-{i}", 3))
    admitted = {s.request_id for s, _ in scheduler.schedule().scheduled}
    assert admitted == {"wide", "one-0"}  # 1 running + 2 forks to come + 1 = max_num_seqs
    assert scheduler.num_running == 2 and scheduler.num_waiting == 2
