"""Tools on a model whose chat template has no tool format (issue 39, item 3), through the official
`openai` client on a real worker: the tiny model with a plain ChatML template that never reads
`tools`. `required` and a named function are held to the calls' grammar, so they parse and validate
whatever the random weights; `auto` reads the generic tagged form the worker's own tool prompt
asks for (the model is held to such text by a regex here, as its weights would never write it);
the prompt carries the worker's tool prompt and the history's calls and results as text; a
template that refuses a system message gets the prompt in the user's turn; a forced call cut by
max_tokens says so."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from tests.engine.server.conftest import WorkerProcess, _worker_processes
from tests.engine.server.tool_support import (
    MESSAGES, ORDER, TOOLS, WEATHER, assert_valid_calls, calls_of, regex_of, streamed)

pytestmark = pytest.mark.e2e

MODEL = "plain"
# ChatML with no tools at all (as many small chat models' templates); <|im_end|> is the EOS token.
PLAIN_TEMPLATE = ("{{- bos_token }}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                  "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Gemma's way: a system message is an error, user and assistant turns must alternate.
NO_SYSTEM_TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}"
    "{%- if m.role == 'system' %}{{ raise_exception('System role not supported') }}{%- endif %}"
    "{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# What a model that follows the generic prompt writes: text, then two calls in tagged blocks.
TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "order_status", "arguments": {"order_id": 42}}\n</tool_call>')
TWO_CALLS_REGEX = regex_of(TWO_CALLS)


@pytest.fixture(scope="module")
def plain_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plain-template") / "tiny-plain"
    shutil.copytree(tiny_model, out)
    (out / "chat_template.jinja").write_text(PLAIN_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def plain_worker(plain_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    with _worker_processes(plain_model, tmp_path_factory.mktemp("plain-worker-logs")) as start:
        yield start("--served-model-name", MODEL, "--trust-request-chat-template")


@pytest.fixture(scope="module")
def api(plain_worker: WorkerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{plain_worker.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(plain_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(plain_model)


def prompt_of(reply: Any, tokenizer: Any) -> str:
    return str(tokenizer.decode(reply.model_extra["prompt_token_ids"]))


@pytest.mark.parametrize(("tool_choice", "parallel", "names"), [
    ("required", None, {"get_weather", "order_status"}),
    ("required", False, {"get_weather", "order_status"}),
    ({"type": "function", "function": {"name": "order_status"}}, None, {"order_status"}),
])
def test_forced_calls_parse_and_validate_on_a_template_without_tools(api: openai.OpenAI, tool_choice: Any,
                                                                     parallel: bool | None, names: set[str]) -> None:
    for seed in range(2):
        args: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
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


def test_the_prompt_carries_the_workers_tool_prompt_and_the_history_as_text(api: openai.OpenAI,
                                                                             tokenizer: Any) -> None:
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    reply = api.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=2, temperature=0,
                                        extra_body={"return_token_ids": True})
    prompt = prompt_of(reply, tokenizer)
    assert prompt.startswith("<|begin_of_text|><|im_start|>system\n# Tools\n\nYou can call the functions below.")
    assert json.dumps(WEATHER["function"]) in prompt and json.dumps(ORDER["function"]) in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": '
            '"celsius"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n21 C\n</tool_response>'
            '<|im_end|>\n<|im_start|>assistant\n') in prompt
    # tool_choice none: no tool prompt, the history as text all the same.
    plain = api.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=2,
                                        temperature=0, extra_body={"return_token_ids": True})
    assert "# Tools" not in prompt_of(plain, tokenizer)
    assert "<tool_response>\n21 C\n</tool_response>" in prompt_of(plain, tokenizer)


def test_auto_reads_the_generic_form_whole_and_streamed(api: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=400, temperature=0,
                                extra_body={"guided_regex": TWO_CALLS_REGEX})
    auto = api.chat.completions.create(**args).choices[0]
    assert auto.finish_reason == "tool_calls"
    assert auto.message.content == "Let me check."
    assert calls_of(auto.message) == [("get_weather", '{"city": "Rome", "unit": "celsius"}'),
                                      ("order_status", '{"order_id": 42}')]
    assert all(call.id.startswith("call_") for call in auto.message.tool_calls)
    assert calls_of(streamed(api, args).message) == calls_of(auto.message)
    one = api.chat.completions.create(**args, parallel_tool_calls=False).choices[0]
    assert calls_of(one.message) == calls_of(auto.message)[:1]
    # Left free, the random model writes no call: a plain reply, not a 400.
    free = api.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=8, temperature=0)
    assert free.choices[0].finish_reason in ("stop", "length") and free.choices[0].message.tool_calls is None


def test_a_template_that_refuses_a_system_message_gets_the_prompt_in_the_users_turn(api: openai.OpenAI,
                                                                                    tokenizer: Any) -> None:
    reply = api.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=400, temperature=1.0,
        seed=0, extra_body={"chat_template": NO_SYSTEM_TEMPLATE, "return_token_ids": True})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message, {"get_weather", "order_status"})
    prompt = prompt_of(reply, tokenizer)
    assert prompt.startswith("<|begin_of_text|><|im_start|>user\n# Tools\n")
    assert prompt.endswith("\n\nWhat is the weather in Rome?<|im_end|>\n<|im_start|>assistant\n")


def test_a_forced_call_cut_by_max_tokens_says_so(api: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=4,
                                temperature=0)
    choice = api.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is None
    details = choice.model_extra["incomplete_details"]
    assert details["reason"] == "max_tokens" and details["param"] == "tool_choice"
    chunks = [chunk for chunk in api.chat.completions.create(**args, stream=True) if chunk.choices]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices[0].model_extra["incomplete_details"] == details
    assert all("incomplete_details" not in chunk.choices[0].model_extra for chunk in chunks[:-1])
