"""Sampling and stopping: greedy, seeded sampling, top-k / top-p, stop strings, stop tokens, EOS,
max tokens, logprobs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft_reference import PeftReference

from serving.engine import LLM, SamplingParams
from serving.engine.sampler import Sampler

PROMPT = "The quick brown fox"
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), max_loras=0, device="cpu", max_model_len=256, num_kv_blocks=64)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPT, seeded)[0].outputs[0].token_ids
    batch = llm.generate(
        ["Hello!", PROMPT, "Once upon a time"],
        [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True), seeded, SamplingParams(temperature=0.7, seed=9)],
    )
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=16, ignore_eos=True)
    assert llm.generate(PROMPT, other_seed)[0].outputs[0].token_ids != alone


def test_top_k_1_and_tiny_top_p_are_greedy(llm: LLM) -> None:
    greedy = llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids
    for params in (
        SamplingParams(temperature=1.5, top_k=1, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.5, top_p=1e-9, max_tokens=16, ignore_eos=True),
    ):
        assert llm.generate(PROMPT, params)[0].outputs[0].token_ids == greedy


def test_stop_strings_cut_exactly(llm: LLM) -> None:
    full = llm.generate(PROMPT, GREEDY)[0].outputs[0]
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = text.index(stop)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop, "never!"]))[0]
    completion = out.outputs[0]
    assert completion.text == text[:cut]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.token_ids == full.token_ids[: len(completion.token_ids)]
    kept = llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    )[0]
    assert kept.outputs[0].text == text[: cut + len(stop)]


def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    full = llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids
    stop_token = full[3]
    first = full.index(stop_token)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_token]))
    completion = out[0].outputs[0]
    assert completion.token_ids == full[: first + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_token
    short = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert short.token_ids == full[:5] and short.finish_reason == "length" and short.stop_reason is None


def test_eos_ids_from_generation_config_end_the_output(tiny_llama_dir: Path, tmp_path: Path, llm: LLM) -> None:
    full = llm.generate(PROMPT, GREEDY)[0].outputs[0]
    eos = full.token_ids[2]
    model_dir = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [config["eos_token_id"], eos]}))
    with_eos = LLM(str(model_dir), max_loras=0, device="cpu", max_model_len=256, num_kv_blocks=64)
    out = with_eos.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    first = full.token_ids.index(eos)
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    ignored = with_eos.generate(PROMPT, GREEDY)[0].outputs[0]
    assert ignored.token_ids == full.token_ids


def test_logprobs_of_chosen_and_top_tokens(llm: LLM, tiny_llama_dir: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    out = llm.generate(PROMPT, params)[0]
    completion = out.outputs[0]
    ref = PeftReference(tiny_llama_dir, {}).generate(out.prompt_token_ids, None, 6)
    assert len(completion.logprobs) == 6
    total = 0.0
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        expected = torch.log_softmax(ref.logits[step], dim=-1)
        top = expected.topk(3)
        assert set(entry) == set(top.indices.tolist()), "greedy: the chosen token is among the top 3"
        assert entry[token].rank == 1
        for tid, logprob in entry.items():
            assert logprob.logprob == pytest.approx(float(expected[tid]), abs=1e-4)
            assert logprob.decoded_token == llm.get_tokenizer().decode([tid])
        total += entry[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total)
    sampled = llm.generate(PROMPT, SamplingParams(temperature=2.0, seed=3, max_tokens=8, ignore_eos=True, logprobs=0))
    for token, entry in zip(sampled[0].outputs[0].token_ids, sampled[0].outputs[0].logprobs):
        assert list(entry) == [token] and entry[token].rank >= 1


def test_sampler_filters_top_k_and_top_p() -> None:
    sampler = Sampler(torch.device("cpu"))
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 2))
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.5)]
    seen: list[set[int]] = [set(), set()]
    generators = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    for _ in range(300):
        tokens = sampler(logits, params, generators).token_ids
        for row, token in enumerate(tokens):
            seen[row].add(token)
    assert seen == [{0, 1}, {0, 1}]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"n": 0}, "n must be a positive integer"),
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logit_bias": {"7": 1.0}}, "logit_bias"),
    ],
)
def test_bad_sampling_params_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
