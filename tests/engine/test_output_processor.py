"""OutputProcessor.output: a request's cumulative output from its sequences, on hand-made states
(no model): the fields of a single sequence's output, best_of's ranking, and outputs that stay as
they were made while the sequences go on."""

from __future__ import annotations

from serving.engine.detokenizer import IncrementalDetokenizer
from serving.engine.output_processor import OutputProcessor
from serving.engine.outputs import Logprob
from serving.engine.sampling_params import SamplingParams
from serving.engine.sequence import RequestState, Sequence

PROMPT = [7, 8, 9]


def _seq(params: SamplingParams, output: list[int], text: str, index: int = 0, logprob: float = 0.0) -> Sequence:
    seq = Sequence(request_id="r", prompt="p", prompt_token_ids=PROMPT, sampling_params=params,
                   detokenizer=IncrementalDetokenizer(lambda ids, skip: "", PROMPT, True), index=index)
    seq.token_ids += output
    seq.output_text = text
    seq.cumulative_logprob = logprob
    if seq.logprobs is not None:
        seq.logprobs += [{t: Logprob(-0.5, 1, None)} for t in output]
    return seq


def _processor() -> OutputProcessor:
    return OutputProcessor(lambda ids, skip: "", eos_token_ids={2}, max_model_len=100)


def test_a_single_sequences_output() -> None:
    """Text held back by the longest stop string less one while unfinished, whole once finished;
    the output's token ids, logprobs and their sum, the reasons, the count of generated tokens."""
    params = SamplingParams(max_tokens=10, logprobs=1, stop=["never!", "no"])
    seq = _seq(params, [11, 12, 13], "hello world", logprob=-1.5)
    state = RequestState("r", params, [seq])
    out = _processor().output(state)
    (completion,) = out.outputs
    assert (out.request_id, out.prompt, out.prompt_token_ids, out.finished) == ("r", "p", PROMPT, False)
    assert (completion.index, completion.text, completion.token_ids) == (0, "hello ", [11, 12, 13])
    assert completion.cumulative_logprob == -1.5 and completion.logprobs == seq.logprobs
    assert (completion.finish_reason, completion.stop_reason, out.num_generated_tokens) == (None, None, 3)
    seq.finish_reason, seq.stop_reason = "stop", "no"
    out = _processor().output(state)
    assert out.finished and out.outputs[0].text == "hello world"
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", "no")


def test_without_logprobs_no_sum_is_shown() -> None:
    params = SamplingParams(max_tokens=10)
    out = _processor().output(RequestState("r", params, [_seq(params, [11], "a", logprob=-2.0)]))
    assert (out.outputs[0].cumulative_logprob, out.outputs[0].logprobs, out.outputs[0].text) == (None, None, "a")


def test_an_error_ends_the_request_whatever_its_sequences() -> None:
    params = SamplingParams(max_tokens=10)
    error = RuntimeError("adapter failed")
    out = _processor().output(RequestState("r", params, [_seq(params, [11], "a")], error=error))
    assert out.finished and out.error is error and out.outputs[0].finish_reason is None


def test_an_output_stays_as_it_was_made() -> None:
    """Outputs are cumulative snapshots: the sequence's next tokens and logprobs do not reach
    those already handed out (the engine-core pipe's deltas are taken against them)."""
    params = SamplingParams(max_tokens=10, logprobs=0)
    seq = _seq(params, [11, 12], "ab")
    state = RequestState("r", params, [seq])
    processor = _processor()
    before = processor.output(state)
    seq.token_ids.append(13)
    assert seq.logprobs is not None
    seq.logprobs.append({13: Logprob(-0.1, 1, None)})
    after = processor.output(state)
    assert before.outputs[0].token_ids == [11, 12] and before.outputs[0].logprobs is not None
    assert len(before.outputs[0].logprobs) == 2 and before.num_generated_tokens == 2
    assert after.outputs[0].token_ids == [11, 12, 13] and after.num_generated_tokens == 3


def test_best_of_shows_the_n_most_likely_once_all_end_and_counts_every_token() -> None:
    params = SamplingParams(n=2, best_of=3, max_tokens=10, logprobs=0)
    seqs = [_seq(params, [11] * (i + 1), f"s{i}", index=i, logprob=lp) for i, lp in enumerate([-3.0, -1.0, -2.0])]
    state = RequestState("r", params, seqs)
    for seq in seqs[:2]:
        seq.finish_reason = "length"
    out = _processor().output(state)
    assert (out.outputs, out.finished, out.num_generated_tokens) == ([], False, 1 + 2 + 3)
    seqs[2].finish_reason = "length"
    out = _processor().output(state)
    assert out.finished and [(c.index, c.text) for c in out.outputs] == [(0, "s1"), (1, "s2")]
