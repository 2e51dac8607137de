"""Issue 37, item 4: every generated token is counted, best_of's discarded sequences included. The
engine's output carries the tokens generated over all of a request's sequences
(`RequestOutput.num_generated_tokens`), and the engine-core pipe's deltas carry it across."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from serving.engine import LLM, SamplingParams
from serving.engine.output_deltas import OutputDecoder, OutputEncoder
from serving.engine.outputs import CompletionOutput, RequestOutput

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), max_loras=0, device="cpu", max_model_len=256, num_kv_blocks=128, block_size=4)


def test_best_of_counts_the_sequences_it_discards(llm: LLM) -> None:
    best = SamplingParams(n=1, best_of=8, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    output = llm.generate(PROMPT, best)[0]
    assert sum(len(c.token_ids) for c in output.outputs) == 6  # the one returned
    assert output.num_generated_tokens == 8 * 6  # all eight generated
    plain = llm.generate(PROMPT, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True))[0]
    assert plain.num_generated_tokens == 2 * 5 == sum(len(c.token_ids) for c in plain.outputs)


def test_the_count_crosses_the_engine_core_pipe() -> None:
    def output(tokens: list[int], generated: int, *, finished: bool) -> RequestOutput:
        return RequestOutput(request_id="r", prompt="p", prompt_token_ids=[1, 2], finished=finished,
                             outputs=[CompletionOutput(index=0, text="x" * len(tokens), token_ids=tokens,
                                                       cumulative_logprob=None, logprobs=None)],
                             num_generated_tokens=generated)

    encoder, decoder = OutputEncoder(), OutputDecoder()
    got = []
    for step in ([output([5], 4, finished=False)], [output([5, 6], 8, finished=True)]):
        got += decoder.decode(pickle.loads(pickle.dumps(encoder.encode(step))))
    assert [o.num_generated_tokens for o in got] == [4, 8]
