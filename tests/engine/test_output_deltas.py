"""The engine-core pipe's output codec: a request's outputs sent as deltas come back whole.

Pure data, no engine: streams of cumulative outputs, including what a delta cannot express as an
append (a text that shrinks, a completion list that changes, a prompt that changes), go through
an encoder, pickling and a decoder, and come out equal to what went in.
"""

from __future__ import annotations

import pickle

from serving.engine.lora.request import LoRARequest
from serving.engine.output_deltas import OutputDecoder, OutputEncoder
from serving.engine.outputs import CompletionOutput, FirstTokenTimes, Logprob, RequestOutput


def _output(rid: str, texts: list[str], tokens: list[list[int]], *, finished: bool = False,
            prompt_ids: list[int] | None = None, logprobs: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id=rid, prompt="p", prompt_token_ids=prompt_ids if prompt_ids is not None else PROMPT,
        outputs=[CompletionOutput(index=i, text=text, token_ids=list(ids), cumulative_logprob=-1.0 * len(ids),
                                  logprobs=[{t: Logprob(-0.5, 1, str(t))} for t in ids] if logprobs else None,
                                  finish_reason="length" if finished else None)
                 for i, (text, ids) in enumerate(zip(texts, tokens))],
        finished=finished, lora_request=LORA)


PROMPT = [1, 2, 3]
LORA = LoRARequest("a", "/adapters/a")


def _roundtrip(steps: list[list[RequestOutput]]) -> tuple[list[list[RequestOutput]], list[list[object]]]:
    encoder, decoder = OutputEncoder(), OutputDecoder()
    got, sent = [], []
    for outputs in steps:
        wire = pickle.loads(pickle.dumps(encoder.encode(outputs)))
        sent.append(wire)
        got.append(decoder.decode(wire))
    return got, sent


def test_cumulative_outputs_cross_as_deltas_and_come_back_whole() -> None:
    steps = [
        [_output("r1", ["he"], [[5]], logprobs=True), _output("r2", ["", ""], [[], []])],
        [_output("r1", ["hello"], [[5, 6]], logprobs=True), _output("r2", ["a", "b"], [[7], [8]])],
        [_output("r1", ["hello w"], [[5, 6, 9]], logprobs=True), _output("r2", ["ab", "b"], [[7, 7], [8]])],
        # A text that is not an extension (a stop string cut it), a completion list that changes.
        [_output("r1", ["hell"], [[5, 6, 9, 4]], logprobs=True), _output("r2", ["x"], [[1]])],
        [_output("r1", ["hello"], [[5, 6, 9, 4, 2]], finished=True, logprobs=True)],
    ]
    got, sent = _roundtrip(steps)
    assert got == steps
    assert isinstance(sent[1][0], tuple) and isinstance(sent[2][1], tuple)  # deltas, not whole outputs
    request_id, finished, (completion,), *_ = sent[1][0]
    assert (request_id, finished) == ("r1", False)
    index, keep_tokens, new_tokens, keep_text, text_tail, *_ = completion
    assert (index, keep_tokens, new_tokens, keep_text, text_tail) == (0, 1, [6], 2, "llo")


def test_a_finished_request_and_a_changed_prompt_go_whole() -> None:
    steps = [
        [_output("r", ["a"], [[1]])],
        [_output("r", ["ab"], [[1, 2]], finished=True)],
        [_output("r", ["c"], [[3]])],  # the id again, after it finished: a new request
        [_output("r", ["cd"], [[3, 4]], prompt_ids=[9, 9])],
    ]
    got, sent = _roundtrip(steps)
    assert got == steps
    assert [type(wire[0]) for wire in sent] == [RequestOutput, tuple, RequestOutput, RequestOutput]


def test_forgotten_requests_start_whole_again() -> None:
    encoder, decoder = OutputEncoder(), OutputDecoder()
    decoder.decode(encoder.encode([_output("r", ["a"], [[1]])]))
    assert encoder.forget("r") and not encoder.forget("r")
    decoder.forget("r")
    again = _output("r", ["ab"], [[1, 2]])
    wire = encoder.encode([again])
    assert isinstance(wire[0], RequestOutput) and decoder.decode(wire) == [again]


def test_prompt_logprobs_come_back_on_every_output_sent_once_unless_they_change() -> None:
    """`prompt_logprobs` (one entry per prompt token, None for the first) is on the first output;
    the deltas after it leave it out (`same`), and the decoder keeps the one it has, or takes the
    new one when it changed (a chunked prompt's entries arriving over two steps)."""
    first_half = [None, {2: Logprob(-1.5, 3, "2")}]
    whole = [*first_half, {3: Logprob(-0.25, 1, "3"), 7: Logprob(-2.0, 2, "7")}]

    def step(texts: list[str], tokens: list[list[int]], prompt_logprobs: list, **kw: bool) -> RequestOutput:
        output = _output("r", texts, tokens, **kw)
        output.prompt_logprobs = prompt_logprobs
        return output

    steps = [
        [step(["a"], [[1]], first_half)],
        [step(["ab"], [[1, 2]], whole)],  # changed: sent
        [step(["abc"], [[1, 2, 3]], whole)],  # the same: not sent, kept
        [step(["abcd"], [[1, 2, 3, 4]], whole, finished=True)],
    ]
    got, sent = _roundtrip(steps)
    assert got == steps
    assert [wire[0][-2:] for wire in sent[1:3]] == [(False, whole), (True, None)]
    assert all(output.prompt_logprobs == (first_half if index == 0 else whole)
               for index, (output,) in enumerate(got))


def test_first_token_times_cross_whole_once_and_stay_on_every_later_output() -> None:
    """A delta has no place for `first_token_times`: the output that first has them goes whole
    (the engine's first output of a request; here one without them comes first), and the decoder
    gives every later output the ones it has."""
    times = FirstTokenTimes(added_ns=10**18, queue=0.25, prefill=0.5, first_token_ns=10**18 + 10**9)

    def step(texts: list[str], tokens: list[list[int]], first_token_times: FirstTokenTimes | None,
             **kw: bool) -> RequestOutput:
        output = _output("r", texts, tokens, **kw)
        output.first_token_times = first_token_times
        return output

    steps = [
        [step([""], [[]], None)],
        [step(["a"], [[1]], times)],
        [step(["ab"], [[1, 2]], times)],
        [step(["abc"], [[1, 2, 3]], times, finished=True)],
    ]
    got, sent = _roundtrip(steps)
    assert got == steps
    assert [type(wire[0]) for wire in sent] == [RequestOutput, RequestOutput, tuple, tuple]


def test_a_steps_first_outputs_in_a_message_ahead_of_the_rest() -> None:
    """EngineCore sends a step's first outputs in a message of their own, then the step's other
    outputs: a message need not hold every request under way, and the next one's deltas still apply."""
    steps = [
        [_output("r1", ["he"], [[5]])],
        [_output("r2", ["a", "b"], [[7], [8]])],  # r2's first output, ahead of the step's
        [_output("r1", ["hello"], [[5, 6]])],  # the same step's rest
        [_output("r3", ["x"], [[1]], finished=True)],  # a first output that ends its request, alone
        [_output("r1", ["hello w"], [[5, 6, 9]]), _output("r2", ["ab", "bc"], [[7, 7], [8, 9]])],
    ]
    got, sent = _roundtrip(steps)
    assert got == steps
    assert [type(item) for wire in sent for item in wire] == [RequestOutput, RequestOutput, tuple, RequestOutput,
                                                             tuple, tuple]
