"""Penalties, logit_bias and min_tokens: the batched sampler against a plain torch reference (one row
and one token at a time) on fixed logits, then through the engine on the tiny model's own logits
(teacher-forced through transformers)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from serving.engine import LLM, SamplingParams
from serving.engine import penalties
from serving.engine.sampler import Sampler
from serving.engine.sequence import Sequence

VOCAB = 12
EOS = 11

pytestmark = pytest.mark.usefixtures("one_thread")


class Row:
    """A row's tokens as the penalties read them (an engine's Sequence, reduced)."""

    def __init__(self, tokens: list[int], prompt_len: int) -> None:
        self.prompt, self.output = np.array(tokens[:prompt_len]), np.array(tokens[prompt_len:])

    @property
    def num_output_tokens(self) -> int:
        return len(self.output)

    def prompt_array(self) -> np.ndarray:
        return self.prompt

    def output_array(self) -> np.ndarray:
        return self.output


def reference(row: torch.Tensor, params: SamplingParams, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """vLLM's processing of one row, written the plain way."""
    row = row.clone()
    prompt, output = tokens[:prompt_len], tokens[prompt_len:]
    if len(output) < params.min_tokens:
        for token in [*(params.stop_token_ids or []), *([] if params.ignore_eos else [EOS])]:
            row[token] = float("-inf")
    for token, bias in (params.logit_bias or {}).items():
        row[token] += bias
    for token in set(prompt) | set(output):
        if params.repetition_penalty != 1.0:
            value = row[token]
            row[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token in set(output):
        row[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return row


ROWS = [
    (SamplingParams(), [1, 2, 3, 4], 2),
    (SamplingParams(presence_penalty=0.7, frequency_penalty=0.3), [1, 2, 5, 5, 5, 2], 2),
    (SamplingParams(repetition_penalty=1.8), [0, 3, 3, 7, 9], 3),
    (SamplingParams(repetition_penalty=0.6, frequency_penalty=-0.5, presence_penalty=-1.2), [4, 4, 6, 6, 8], 1),
    (SamplingParams(logit_bias={3: 5.0, 7: -250.0, 10: 100.0}), [1, 3], 1),
    (SamplingParams(min_tokens=4, stop_token_ids=[2, 6], max_tokens=8), [1, 5, 5], 1),
    (SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[6], max_tokens=8), [1, 5, 5], 1),
    (SamplingParams(min_tokens=2, stop_token_ids=[6], max_tokens=8), [1, 5, 5], 1),  # reached: nothing banned
    (SamplingParams(presence_penalty=2.0, repetition_penalty=1.3, logit_bias={0: 1.5}, min_tokens=9, max_tokens=9,
                    stop_token_ids=[3]), [9, 0, 0, 1, 3, 1], 2),
]


@pytest.fixture
def fixed_logits() -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(len(ROWS), VOCAB, generator=generator) * 3
    logits[2, 3] = -abs(logits[2, 3])  # repetition on a negative logit multiplies
    logits[2, 7] = abs(logits[2, 7])  # and on a positive one divides
    return logits


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.parametrize("device", DEVICES)
def test_processing_equals_the_plain_reference(fixed_logits: torch.Tensor, device: str) -> None:
    params = [p for p, _, _ in ROWS]
    history = [Row(tokens, prompt_len) for _, tokens, prompt_len in ROWS]
    processed = fixed_logits.to(device, copy=True)
    penalties.apply(processed, params, history, {EOS})
    processed = processed.cpu()
    for i, (p, tokens, prompt_len) in enumerate(ROWS):
        torch.testing.assert_close(processed[i], reference(fixed_logits[i], p, tokens, prompt_len), msg=f"row {i}")
    assert processed[4, 7] == fixed_logits[4, 7] - 100.0  # logit_bias is clamped to [-100, 100]
    assert torch.equal(processed[0], fixed_logits[0])  # a row without any of them is untouched
    assert not penalties.needs_processing([ROWS[0][0], ROWS[7][0]], [Row(ROWS[0][1], 2), Row(ROWS[7][1], 1)])


@pytest.mark.parametrize("temperature", [0.0, 0.8, 1.5])
def test_sampled_tokens_equal_the_reference_sampling(fixed_logits: torch.Tensor, temperature: float) -> None:
    """Greedy is the processed argmax; a seeded row draws as the exponential race on the processed,
    tempered distribution with its own generator: the same token as the reference, seed for seed."""
    sampler = Sampler(torch.device("cpu"), eos_token_ids={EOS})
    params = [SamplingParams(**{**_fields(p), "temperature": temperature}) for p, _, _ in ROWS]
    history = [Row(tokens, prompt_len) for _, tokens, prompt_len in ROWS]
    for seed in range(20):
        generators: list[torch.Generator | None] = [torch.Generator().manual_seed(seed + i) for i in range(len(ROWS))]
        got = sampler(fixed_logits, params, generators, None, history).token_ids
        for i, (p, tokens, prompt_len) in enumerate(ROWS):
            row = reference(fixed_logits[i], p, tokens, prompt_len)
            if temperature == 0.0:
                expected = int(row.argmax())
            else:
                probs = torch.softmax(row / temperature, dim=-1)
                race = torch.empty(VOCAB).exponential_(generator=torch.Generator().manual_seed(seed + i))
                expected = int((probs / race).argmax())
            assert got[i] == expected, f"row {i}, seed {seed}"


def test_logprobs_stay_raw(fixed_logits: torch.Tensor) -> None:
    sampler = Sampler(torch.device("cpu"), eos_token_ids={EOS})
    params = [SamplingParams(temperature=0, logit_bias={5: 100.0}, logprobs=1)]
    result = sampler(fixed_logits[:1], params, [None], None, [Row([1], 1)])
    raw = torch.log_softmax(fixed_logits[0], dim=-1)
    assert result.token_ids == [5]
    assert result.logprobs is not None and result.logprobs[0] == pytest.approx(float(raw[5]))
    assert result.top_ids is not None and result.top_ids[0] == [int(raw.argmax())]


def _fields(params: SamplingParams) -> dict[str, object]:
    return {name: getattr(params, name) for name in (
        "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "max_tokens",
        "stop_token_ids", "ignore_eos")}


# ---- through the engine -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), max_loras=0, device="cpu", max_model_len=256, num_kv_blocks=64)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.6),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.8),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=-1.0, logit_bias={17: 0.5, 40: 3}),
], ids=["repetition", "presence-frequency", "negative-frequency-bias"])
def test_engine_greedy_equals_the_reference_on_the_models_logits(llm: LLM, hf_model: torch.nn.Module,
                                                                  params: SamplingParams) -> None:
    """Each token the engine chose is the argmax of the reference's processing of transformers'
    logits for the same context (teacher-forced: one forward over the prompt and the output)."""
    prompt = llm.get_tokenizer()("The quick brown fox jumps over").input_ids
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    out = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    assert out != plain[0].outputs[0].token_ids  # the penalty changed something, so the check bites
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + out])).logits[0].float()
    for step, token in enumerate(out):
        context = prompt + out[:step]
        row = reference(logits[len(context) - 1], params, context, len(prompt))
        top2 = row.topk(2).values
        if top2[0] - top2[1] < 1e-4:
            break  # a tie: fp32 summation order may pick either, and the contexts part from here
        assert token == int(row.argmax()), f"step {step}"


def test_min_tokens_holds_back_stop_tokens_and_eos(llm: LLM, tiny_llama_dir: Path) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = llm.generate("Once upon a time", greedy)[0].outputs[0].token_ids
    stop = tokens[1]
    early = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop]))
    assert len(early[0].outputs[0].token_ids) <= 2
    held = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop],
                                                          min_tokens=8))[0].outputs[0]
    assert len(held.token_ids) >= 8 and stop not in held.token_ids[:8]
    assert held.finish_reason == "length" or held.token_ids[-1] == stop
    eos = sorted(llm.llm_engine.eos_token_ids)[0]
    forced = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=10, min_tokens=6,
                                                            logit_bias={eos: 100.0}))[0].outputs[0]
    # EOS is banned for six tokens whatever its bias, then taken at once.
    assert forced.token_ids[:6].count(eos) == 0 and forced.token_ids[6] == eos and len(forced.token_ids) == 7
    assert forced.finish_reason == "stop"


def test_logit_bias_outside_the_vocabulary_is_refused(llm: LLM) -> None:
    vocab = llm.llm_engine.hf_config.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias token id {vocab} is outside the vocabulary"):
        llm.generate("Hi", SamplingParams(logit_bias={vocab: 1.0}))


def test_prompt_logprobs_are_the_models_own(tiny_llama_dir: Path, hf_model: torch.nn.Module) -> None:
    """Each prompt token's logprob given the tokens before it, from the prefill, in chunks and
    with n forks: transformers' log-softmax over the same prompt."""
    llm = LLM(str(tiny_llama_dir), max_loras=0, device="cpu", max_model_len=256, num_kv_blocks=64,
              max_num_batched_tokens=8)  # the prompt is prefilled in chunks of at most 8 tokens
    prompt = llm.get_tokenizer()("The quick brown fox jumps over the lazy dog and runs away").input_ids
    assert len(prompt) > 8
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=2, max_tokens=3, prompt_logprobs=2))[0]
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    for position, entry in enumerate(entries[1:], 1):
        assert entry is not None
        token = prompt[position]
        assert entry[token].logprob == pytest.approx(float(logp[position - 1, token]), abs=1e-4)
        assert entry[token].rank == 1 + int((logp[position - 1] > logp[position - 1, token]).sum())
        assert {int(t) for t in logp[position - 1].topk(2).indices} <= set(entry)


def test_a_sequences_token_arrays_follow_its_tokens() -> None:
    """The arrays the penalties read grow with the sequence (past their capacity, by one token or
    many between reads) and always equal its prompt and output."""
    seq = Sequence(request_id="r", prompt=None, prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(),
                   detokenizer=None)  # type: ignore[arg-type]  # never decoded here
    assert seq.prompt_array().tolist() == [5, 6, 7] and seq.output_array().tolist() == []
    for burst in (1, 1, 3, 20, 1, 40):
        seq.token_ids.extend(range(len(seq.token_ids), len(seq.token_ids) + burst))
        assert seq.output_array().tolist() == seq.output_token_ids
    assert seq.prompt_array().tolist() == [5, 6, 7]
