"""Sampling through the official `openai` client on the shared worker: penalties, logit_bias and
min_tokens (what the offline engine generates with the same parameters), `n` and `best_of`, a
list of prompts in one completions request (choices prompt-major, usage summed), `echo`, streamed
and not; and the fields still refused, each a 400 naming it."""

from __future__ import annotations

from collections import defaultdict

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from serving.engine import SamplingParams
from tests.engine.server.conftest import WorkerProcess

BASE = "tiny-base"
PROMPT = "The quick brown fox"
OTHER = "Question: What is the capital of Italy? Answer:"


def client(worker: WorkerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)


def streamed_choices(stream: openai.Stream) -> tuple[dict[int, str], dict[int, str | None], object]:
    """A completions stream reassembled by choice index: texts, finish reasons, usage."""
    texts: dict[int, str] = defaultdict(str)
    finish: dict[int, str | None] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    return dict(texts), finish, usage


@pytest.mark.parametrize("fields", [
    {"presence_penalty": 1.5, "frequency_penalty": 0.7},
    {"extra_body": {"repetition_penalty": 1.7, "min_tokens": 10}, "stop": ["."]},
    {"logit_bias": {"17": 6, "40": -100}, "frequency_penalty": -0.5},
], ids=["presence-frequency", "repetition-min-tokens", "logit-bias"])
def test_penalties_and_logit_bias_generate_what_the_engine_does(worker: WorkerProcess, offline, fields) -> None:
    api = client(worker)
    extra = dict(fields.get("extra_body", {}))
    args = {k: v for k, v in fields.items() if k != "extra_body"}
    response = api.completions.create(model=BASE, prompt=PROMPT, max_tokens=20, temperature=0,
                                      extra_body={"return_token_ids": True, **extra}, **args)
    params = SamplingParams(temperature=0, max_tokens=20, stop=args.get("stop"),
                            presence_penalty=args.get("presence_penalty", 0.0),
                            frequency_penalty=args.get("frequency_penalty", 0.0),
                            repetition_penalty=extra.get("repetition_penalty", 1.0),
                            min_tokens=extra.get("min_tokens", 0),
                            logit_bias={int(k): v for k, v in args.get("logit_bias", {}).items()} or None)
    expected = offline.generate(PROMPT, params)[0].outputs[0]
    plain = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert expected.token_ids != plain.token_ids  # the fields change the output, so ignoring them would show
    assert response.choices[0].token_ids == expected.token_ids
    assert response.choices[0].text == expected.text
    stream = api.completions.create(model=BASE, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                    extra_body=extra, **args)
    assert streamed_choices(stream)[0] == {0: expected.text}
    api.close()


def test_n_choices_streamed_and_not(worker: WorkerProcess, offline) -> None:
    api = client(worker)
    whole = api.completions.create(model=BASE, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=11, n=3)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = {c.index: c.text for c in whole.choices}
    assert len(set(texts.values())) > 1  # three samples, not one copied
    stream = api.completions.create(model=BASE, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=11, n=3,
                                    stream=True, stream_options={"include_usage": True})
    streamed, finish, usage = streamed_choices(stream)
    assert streamed == texts and set(finish) == {0, 1, 2}
    prompt_len = len(offline.get_tokenizer()(PROMPT).input_ids)
    assert whole.usage.prompt_tokens == prompt_len == usage.prompt_tokens
    assert whole.usage.completion_tokens == 36 == usage.completion_tokens
    # Greedy: n copies of the one greedy completion.
    greedy = api.completions.create(model="alpha", prompt=PROMPT, max_tokens=10, temperature=0, n=2)
    one = api.completions.create(model="alpha", prompt=PROMPT, max_tokens=10, temperature=0)
    assert [c.text for c in greedy.choices] == [one.choices[0].text] * 2
    api.close()


def test_n_prefills_the_prompt_once(worker: WorkerProcess, offline) -> None:
    """Each prompt's tokens are prefilled once or found in the prefix cache, whatever n."""
    prompt_len = len(offline.get_tokenizer()(OTHER).input_ids)

    def computed_or_cached() -> float:
        return worker.metric("loraplex_prefill_tokens_total") + worker.metric("loraplex_prefix_cache_hits_total")

    before = computed_or_cached()
    api = client(worker)
    api.completions.create(model="alpha", prompt=OTHER, max_tokens=4, temperature=1.0, n=4)
    assert computed_or_cached() - before == prompt_len
    api.completions.create(model="alpha", prompt=[OTHER] * 2, max_tokens=4, temperature=1.0, n=4)
    assert computed_or_cached() - before == 3 * prompt_len  # one prefill a prompt
    api.close()


def test_a_list_of_prompts_gives_prompt_major_choices(worker: WorkerProcess, offline) -> None:
    api = client(worker)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    expected = [o.outputs[0].text for o in offline.generate([PROMPT, OTHER], greedy)]
    tokenizer = offline.get_tokenizer()
    prompt_ids = [tokenizer(p).input_ids for p in (PROMPT, OTHER)]
    for prompt in ([PROMPT, OTHER], prompt_ids):
        whole = api.completions.create(model=BASE, prompt=prompt, max_tokens=8, temperature=0, n=2)
        assert [(c.index, c.text) for c in whole.choices] == [
            (0, expected[0]), (1, expected[0]), (2, expected[1]), (3, expected[1])]
        assert whole.usage.prompt_tokens == sum(len(ids) for ids in prompt_ids)
        assert whole.usage.completion_tokens == 4 * 8
        stream = api.completions.create(model=BASE, prompt=prompt, max_tokens=8, temperature=0, n=2, stream=True)
        assert streamed_choices(stream)[0] == {c.index: c.text for c in whole.choices}
    api.close()


def test_best_of_returns_the_most_likely(worker: WorkerProcess) -> None:
    api = client(worker)
    best = api.completions.create(model=BASE, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, n=2, best_of=4)
    everything = api.completions.create(model=BASE, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, n=4,
                                        logprobs=0)
    ranked = sorted(everything.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    api.close()


def test_echo_puts_the_prompt_first(worker: WorkerProcess, offline) -> None:
    api = client(worker)
    plain = api.completions.create(model=BASE, prompt=[PROMPT, OTHER], max_tokens=6, temperature=0)
    echoed = api.completions.create(model=BASE, prompt=[PROMPT, OTHER], max_tokens=6, temperature=0, echo=True)
    assert [c.text for c in echoed.choices] == [PROMPT + plain.choices[0].text, OTHER + plain.choices[1].text]
    stream = api.completions.create(model=BASE, prompt=[PROMPT, OTHER], max_tokens=6, temperature=0, echo=True,
                                    stream=True)
    assert streamed_choices(stream)[0] == {0: echoed.choices[0].text, 1: echoed.choices[1].text}
    ids = offline.get_tokenizer()(PROMPT).input_ids
    by_ids = api.completions.create(model=BASE, prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert by_ids.choices[0].text == offline.get_tokenizer().decode(ids) + plain.choices[0].text
    api.close()


def test_echo_with_logprobs_gives_the_prompts_too(worker: WorkerProcess, offline) -> None:
    """OpenAI's shape: the prompt's tokens first (the first without a logprob), then the
    completion's; offsets run over the echoed text; streamed, the same lists."""
    api = client(worker)
    ids = offline.get_tokenizer()(OTHER).input_ids
    expected = offline.generate(OTHER, SamplingParams(temperature=0, max_tokens=5, logprobs=1, prompt_logprobs=1))[0]
    whole = api.completions.create(model=BASE, prompt=OTHER, max_tokens=5, temperature=0, echo=True, logprobs=1)
    logprobs = whole.choices[0].logprobs
    assert len(logprobs.tokens) == len(ids) + 5
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    want = [entry[token].logprob for token, entry in zip(ids[1:], expected.prompt_logprobs[1:])]
    want += [entry[token].logprob for token, entry in zip(expected.outputs[0].token_ids, expected.outputs[0].logprobs)]
    assert logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert all(len(top) >= 1 for top in logprobs.top_logprobs[1:])
    texts = logprobs.tokens
    assert logprobs.text_offset == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    streamed: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in api.completions.create(model=BASE, prompt=OTHER, max_tokens=5, temperature=0, echo=True, logprobs=1,
                                        stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed["tokens"] += choice.logprobs.tokens
                streamed["token_logprobs"] += choice.logprobs.token_logprobs
                streamed["text_offset"] += choice.logprobs.text_offset
    assert streamed == {"tokens": logprobs.tokens, "token_logprobs": logprobs.token_logprobs,
                        "text_offset": logprobs.text_offset}
    api.close()


def test_chat_n_choices_streamed_and_not(worker: WorkerProcess) -> None:
    api = client(worker)
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = api.chat.completions.create(model="beta", messages=messages, max_tokens=10, temperature=1.0, seed=2, n=3)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert len({c.message.content for c in whole.choices}) > 1
    assert whole.usage.completion_tokens == sum(10 for _ in whole.choices)
    # Reassembled as the SDK's own stream helper does (by choice index), without its parsing step.
    state = ChatCompletionStreamState()
    roles = set()
    for chunk in api.chat.completions.create(model="beta", messages=messages, max_tokens=10, temperature=1.0, seed=2,
                                             n=3, stream=True):
        state.handle_chunk(chunk)
        roles |= {choice.index for choice in chunk.choices if choice.delta.role == "assistant"}
    streamed = state.current_completion_snapshot
    assert roles == {0, 1, 2}
    assert [(c.index, c.message.content, c.finish_reason) for c in streamed.choices] == [
        (c.index, c.message.content, c.finish_reason) for c in whole.choices]
    api.close()


@pytest.mark.parametrize("fields,param,words", [
    ({"suffix": " the end."}, "suffix", "fill-in-the-middle"),
    ({"n": 3, "best_of": 2}, "best_of", "at least n"),
    ({"best_of": 3, "stream": True}, "best_of", "cannot be streamed"),
    ({"logit_bias": {"not-a-token": 3}}, "logit_bias", "token ids of this model"),
    ({"logit_bias": {"1000000": 3}}, "logit_bias", "token ids of this model"),
    ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty", "repetition_penalty"),
    ({"extra_body": {"min_tokens": 9}}, "min_tokens", "min_tokens"),
    ({"n": 300}, "n", "max_num_seqs"),
    ({"prompt": []}, "prompt", "empty list"),
])
def test_refused_fields_are_400s_naming_them(worker: WorkerProcess, fields: dict, param: str, words: str) -> None:
    api = client(worker)
    args = {"model": BASE, "prompt": PROMPT, "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        response = api.completions.create(**args)
        if args.get("stream"):
            list(response)
    assert refused.value.body["param"] == param
    assert words in refused.value.message
    api.close()
