"""Turning sampled tokens into outputs: each new token appended to its sequence (its logprobs, its
text, the stop conditions), and a request's sequences into its ``RequestOutput``.

A request of ``best_of > n`` is judged when all its sequences have ended: the ``n`` of highest
cumulative log-probability (the chosen tokens' raw logprobs summed, ties to the lower index) are
returned, re-indexed from 0; until then it has no output to show.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from serving.engine.outputs import CompletionOutput, Logprob, RequestOutput
from serving.engine.sampler import SampleResult
from serving.engine.sequence import RequestState, Sequence


class OutputProcessor:
    def __init__(self, decode: Callable[[list[int], bool], str], eos_token_ids: Collection[int],
                 max_model_len: int) -> None:
        self._decode = decode
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def append(self, seq: Sequence, row: int, samples: SampleResult) -> None:
        """Append row ``row``'s token to ``seq``; sets its ``finish_reason`` when that ends it."""
        token = samples.token_ids[row]
        params = seq.sampling_params
        assert params.stop_token_ids is not None  # SamplingParams.__post_init__ makes it a list
        seq.token_ids.append(token)
        if seq.guide is not None and not seq.guide.accept(token):
            seq.error = seq.guide.refusal(token)  # the grammar's dead end, or an engine bug
            seq.finish_reason = "error"
            return
        if samples.logprobs is not None:
            seq.cumulative_logprob += samples.logprobs[row]
            if seq.logprobs is not None:
                self._record_logprobs(seq, row, token, samples)
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            seq.finish_reason = "stop"
            seq.stop_reason = token if token in params.stop_token_ids else None
            if params.detokenize:
                seq.output_text += seq.detokenizer.flush()
            return
        # Once per sampled sequence every step: Sequence's length properties are read inline.
        num_output = len(seq.token_ids) - len(seq.prompt_token_ids)
        delta = seq.detokenizer.add(token) if params.detokenize else ""
        if delta:
            seq.output_text += delta
            # Until min_tokens are out a stop string does not end the output either (as vLLM).
            stops = params.stop_matcher
            if stops is not None and num_output >= params.min_tokens:
                found = stops.find(seq.output_text, len(delta))
                if found is not None:
                    index, stop = found
                    seq.output_text = seq.output_text[: index + (len(stop) if params.include_stop_str_in_output else 0)]
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    return
        if (params.max_tokens is not None and num_output >= params.max_tokens) or (
            len(seq.token_ids) >= self.max_model_len
        ):
            seq.finish_reason = "length"
            if params.detokenize:
                seq.output_text += seq.detokenizer.flush()

    def _record_logprobs(self, seq: Sequence, row: int, token: int, samples: SampleResult) -> None:
        assert seq.logprobs is not None and samples.logprobs is not None
        assert samples.ranks is not None and samples.top_ids is not None and samples.top_logprobs is not None
        num_top = seq.sampling_params.logprobs or 0
        detokenize = seq.sampling_params.detokenize

        def text(tid: int) -> str | None:
            return self._decode([tid], False) if detokenize else None

        entry = {token: Logprob(samples.logprobs[row], samples.ranks[row], text(token))}
        for rank, (tid, lp) in enumerate(zip(samples.top_ids[row][:num_top], samples.top_logprobs[row][:num_top]), 1):
            entry.setdefault(tid, Logprob(lp, rank, text(tid)))
        seq.logprobs.append(entry)

    def output(self, state: RequestState) -> RequestOutput:
        """The request's output so far (cumulative); ``best_of > n``: empty until it has ended."""
        # Once per request that sampled, every step: a single sequence's case reads RequestState's
        # properties (first, finished) inline and skips the sum over a generator; the outputs are
        # built with positional arguments (half the cost of keywords; mypy checks their types).
        params = state.sampling_params
        seqs = state.seqs
        first = seqs[0]
        prompt_length = len(first.prompt_token_ids)
        if params.best_of == 1:  # n = 1 too: one sequence, never forked, always shown
            done = first.finish_reason is not None
            finished = done or state.error is not None
            outputs = [_completion(first, 0, done)]
            generated = len(first.token_ids) - prompt_length
        else:
            finished = state.finished or state.error is not None
            if params.num_sequences > params.n:
                ranked = sorted(seqs, key=lambda s: (-s.cumulative_logprob, s.index)) if finished else []
                shown = ranked[: params.n]
            else:
                shown = seqs
            outputs = [_completion(seq, index, seq.finish_reason is not None) for index, seq in enumerate(shown)]
            generated = sum(len(seq.token_ids) - len(seq.prompt_token_ids) for seq in seqs)
        prompt_logprobs = first.prompt_logprobs
        return RequestOutput(state.request_id, first.prompt, first.prompt_token_ids, outputs, finished,
                             first.lora_request, state.error,
                             list(prompt_logprobs) if prompt_logprobs is not None else None,
                             first.num_cached_tokens, generated, state.first_token_times)


def _completion(seq: Sequence, index: int, finished: bool) -> CompletionOutput:
    text = seq.output_text
    stops = seq.sampling_params.stop_matcher
    if not finished and stops is not None:
        # Hold back what could be the start of a stop string, so a streamed text never shows
        # characters the final text cuts: every streamed text is a prefix of the final one.
        hold = stops.max_len - 1
        text = text[: max(0, len(text) - hold)]
    logprobs = seq.logprobs
    if logprobs is None:  # logprobs not asked for: no cumulative log-probability shown either
        return CompletionOutput(index, text, seq.token_ids[len(seq.prompt_token_ids) :], None, None,
                                seq.finish_reason, seq.stop_reason)
    return CompletionOutput(index, text, seq.token_ids[len(seq.prompt_token_ids) :], seq.cumulative_logprob,
                            list(logprobs), seq.finish_reason, seq.stop_reason)
