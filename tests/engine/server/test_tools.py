"""Tools through the official `openai` client on a real worker. The tiny model's template writes
Hermes' `<tool_call>` form, so the worker reads its replies as hermes (auto detection): with
`tool_choice` required or named the reply is held to the calls' grammar and always parses, its
arguments valid against the function's schema, streamed as OpenAI's SDK reassembles it; a call and
its result in the history render through the template; `none` leaves call-shaped text as content;
a tool_choice or history the worker cannot honour is a 400 naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.engine.server.conftest import WorkerProcess
from tests.engine.server.tool_support import (
    MESSAGES, ORDER, SCHEMAS, TOOLS, WEATHER, assert_valid_calls, calls_of, regex_of, streamed)

BASE = "tiny-base"
# A reply the model is held to by a regex: text, then two calls in the template's own form.
TWO_CALLS = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "order_status", "arguments": {"order_id": 42}}\n</tool_call>')
TWO_CALLS_REGEX = regex_of(TWO_CALLS)


def client(worker: WorkerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize(("tool_choice", "parallel", "names"), [
    ("required", None, {"get_weather", "order_status"}),
    ("required", False, {"get_weather", "order_status"}),
    ({"type": "function", "function": {"name": "order_status"}}, None, {"order_status"}),
])
def test_forced_calls_always_parse_and_validate_streamed_and_not(worker: WorkerProcess, tool_choice: Any,
                                                                 parallel: bool | None, names: set[str]) -> None:
    api = client(worker)
    for seed in range(3):
        args: dict[str, Any] = dict(model=BASE, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                    max_tokens=400, temperature=1.0, seed=seed)
        if parallel is not None:
            args["parallel_tool_calls"] = parallel
        choice = api.chat.completions.create(**args).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert_valid_calls(choice.message, names)
        if parallel is False or len(names) == 1:
            assert len(choice.message.tool_calls) == 1
        again = streamed(api, args)
        assert again.finish_reason == "tool_calls"
        assert not again.message.content
        assert calls_of(again.message) == calls_of(choice.message)


def test_streamed_deltas_have_openais_shape(worker: WorkerProcess) -> None:
    api = client(worker)
    chunks = list(api.chat.completions.create(model="alpha", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                              max_tokens=400, temperature=0, stream=True,
                                              extra_body={"guided_regex": TWO_CALLS_REGEX}))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(delta.content or "" for delta in deltas) == "Sure."
    pieces = [piece for delta in deltas for piece in delta.tool_calls or []]
    for index, name, arguments in ((0, "get_weather", '{"city": "Rome", "unit": "celsius"}'),
                                   (1, "order_status", '{"order_id": 42}')):
        mine = [piece for piece in pieces if piece.index == index]
        first, rest = mine[0], mine[1:]
        assert first.id and first.type == "function" and first.function.name == name
        assert all(piece.id is None and piece.function.name is None for piece in rest)
        assert "".join(piece.function.arguments or "" for piece in mine) == arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_reads_calls_and_none_leaves_them_as_text(worker: WorkerProcess) -> None:
    api = client(worker)
    args: dict[str, Any] = dict(model=BASE, messages=MESSAGES, tools=TOOLS, max_tokens=400, temperature=0,
                                extra_body={"guided_regex": TWO_CALLS_REGEX})
    auto = api.chat.completions.create(**args).choices[0]
    assert auto.finish_reason == "tool_calls"
    assert auto.message.content == "Sure."
    assert calls_of(auto.message) == [("get_weather", '{"city": "Rome", "unit": "celsius"}'),
                                      ("order_status", '{"order_id": 42}')]
    assert calls_of(streamed(api, args).message) == calls_of(auto.message)
    one = api.chat.completions.create(**args, parallel_tool_calls=False).choices[0]
    assert calls_of(one.message) == calls_of(auto.message)[:1]
    plain = api.chat.completions.create(**args, tool_choice="none").choices[0]
    assert plain.finish_reason == "stop"
    assert plain.message.content == TWO_CALLS and plain.message.tool_calls is None


def test_a_call_and_its_result_round_trip_through_the_template(worker: WorkerProcess, tiny_model: Path) -> None:
    api = client(worker)
    first = api.chat.completions.create(model=BASE, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=1.0,
                                        seed=1, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.id, "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    answer = api.chat.completions.create(model=BASE, messages=history, tools=TOOLS, max_tokens=12, temperature=0,
                                         extra_body={"return_token_ids": True})
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    assert isinstance(choice.message.content, str)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rendered = [*MESSAGES,
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": call.id, "type": "function",
                     "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    expected = tokenizer.apply_chat_template(rendered, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.decode(answer.model_extra["prompt_token_ids"])
    assert prompt == expected
    assert f"<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {call.function.arguments}}}\n</tool_call>" in prompt
    assert "<tool_response>\n{\"temperature\": 21}\n</tool_response>" in prompt


def test_legacy_functions_reply_with_function_call(worker: WorkerProcess) -> None:
    api = client(worker)
    args: dict[str, Any] = dict(model=BASE, messages=MESSAGES, functions=[WEATHER["function"]],
                                function_call={"name": "get_weather"}, max_tokens=200, temperature=1.0, seed=0)
    choice = api.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "function_call"
    assert choice.message.function_call.name == "get_weather"
    jsonschema.validate(json.loads(choice.message.function_call.arguments), SCHEMAS["get_weather"])
    chunks = [c.choices[0] for c in api.chat.completions.create(**args, stream=True) if c.choices]
    pieces = [c.delta.function_call for c in chunks if c.delta.function_call]
    assert pieces[0].name == "get_weather"
    assert "".join(piece.arguments or "" for piece in pieces) == choice.message.function_call.arguments
    assert chunks[-1].finish_reason == "function_call"


@pytest.mark.parametrize(("kwargs", "param", "message"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch_rocket"}}}, "tool_choice",
     "'launch_rocket', which is not among the tools (get_weather, order_status)"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools to call"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "define get_weather more than once"),
    ({"tools": TOOLS, "functions": [ORDER["function"]]}, "functions", "not both"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}],
      "tool_choice": "required"}, "tools", 'Unsupported type "frobnicate"'),
    ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "is not JSON"),
    ({"messages": [*MESSAGES, {"role": "tool", "tool_call_id": "call_9", "content": "21"}]},
     "messages[1].tool_call_id", "answers no call"),
])
def test_tool_requests_the_worker_cannot_honour_are_400s_naming_the_field(
        worker: WorkerProcess, kwargs: dict[str, Any], param: str, message: str) -> None:
    args: dict[str, Any] = {"model": BASE, "messages": MESSAGES, "max_tokens": 8, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client(worker).chat.completions.create(**args)
    error = caught.value.body
    assert isinstance(error, dict)
    assert message in error["message"]
    assert error["param"] == param


@pytest.mark.parametrize("model", [BASE, "beta"])
def test_a_conversation_with_tools_gives_the_offline_apis_tokens(worker: WorkerProcess, offline: Any,
                                                                 adapters: dict[str, Path], model: str) -> None:
    from serving.engine import LoRARequest, SamplingParams

    call = {"id": "call_7", "type": "function", "function": {"name": "order_status", "arguments": '{"order_id": 7}'}}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_7", "content": "shipped"}]
    reply = client(worker).chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                                   max_tokens=12, temperature=0,
                                                   extra_body={"return_token_ids": True})
    rendered = [*history[:1], {**history[1], "content": "",
                               "tool_calls": [{**call, "function": {**call["function"], "arguments": {"order_id": 7}}}]},
                history[2]]
    lora = None if model == BASE else LoRARequest(model, str(adapters[model]))
    expected = offline.chat(rendered, SamplingParams(temperature=0, max_tokens=12), lora, tools=TOOLS)[0]
    assert reply.model_extra["prompt_token_ids"] == expected.prompt_token_ids
    assert reply.choices[0].model_extra["token_ids"] == expected.outputs[0].token_ids
    assert reply.choices[0].message.content == expected.outputs[0].text
