"""The worker's own tool prompt (serving.engine.server.tool_prompt), for a chat template without a
tool format it reads: when it is used, what it says for each tool_choice, and how a conversation
with calls and results is rewritten into messages any template renders. In-process, on crafted
conversations; tests/engine/server/test_generic_tools.py runs it through a worker."""

from __future__ import annotations

import json
from typing import Any

import pytest

from serving.contracts.protocol import ChatCompletionRequest
from serving.engine.server.tool_parsers import GENERIC, LLAMA3_JSON, family_for, parse
from serving.engine.server.tool_prompt import call_text, is_prompted, prompted_messages, tool_prompt
from serving.engine.server.tool_requests import ToolPlan, template_messages, tool_plan
from serving.engine.tiny import CHAT_TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PING = {"type": "function", "function": {"name": "ping"}}
PLAIN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def plan(**fields: Any) -> ToolPlan:
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER, PING],
                                 **fields)
    found = tool_plan(body, GENERIC)
    assert found is not None
    return found


@pytest.mark.parametrize(("template", "choice", "expected"), [
    (PLAIN_TEMPLATE, "auto", True),  # no tool format: generic family, the worker's prompt
    (CHAT_TEMPLATE, "auto", False),  # the template's own Hermes prompt
    (CHAT_TEMPLATE, "generic", True),  # the operator chose the generic form over the template's
    (PLAIN_TEMPLATE, "hermes", True),  # a named family, but the template never renders the tools
    (CHAT_TEMPLATE, "none", False),  # tool calls off
])
def test_the_worker_writes_the_tools_when_the_template_cannot(template: str, choice: str, expected: bool) -> None:
    assert is_prompted(family_for(choice, template), template) is expected


def test_the_prompt_lists_the_functions_and_the_form_of_a_call() -> None:
    prompt = tool_prompt(plan(), GENERIC)
    assert json.dumps(WEATHER["function"]) in prompt and json.dumps(PING["function"]) in prompt
    assert '<tool_call>\n{"name": "<function name>", "arguments": <arguments object>}\n</tool_call>' in prompt
    assert "To call several at once" in prompt
    assert "Call one only when it helps" in prompt
    # The form it shows is the one the family's parser reads.
    example = call_text(GENERIC, [("get_weather", {"city": "Rome"}), ("ping", {})])
    assert [call.name for call in parse(GENERIC, example).calls] == ["get_weather", "ping"]


@pytest.mark.parametrize(("fields", "says", "never"), [
    ({"tool_choice": "required"}, "You must call at least one of them.", "Call one only when"),
    ({"tool_choice": "required", "parallel_tool_calls": False}, "You must call one of them, once.",
     "several at once"),
    ({"tool_choice": {"type": "function", "function": {"name": "ping"}}}, "You must call the function ping, once.",
     "several at once"),
    ({"parallel_tool_calls": False}, "Call at most one function in a reply.", "several at once"),
])
def test_the_prompt_says_what_tool_choice_asks(fields: dict[str, Any], says: str, never: str) -> None:
    prompt = tool_prompt(plan(**fields), GENERIC)
    assert says in prompt
    assert never not in prompt


def test_a_familys_own_form_is_the_one_asked_for() -> None:
    # A named family on a template that does not render tools: its form, its arguments key.
    prompt = tool_prompt(plan(), LLAMA3_JSON)
    assert '{"name": "<function name>", "parameters": <arguments object>}; {"name"' in prompt


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Rome and Oslo?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "3 C"},
    {"role": "user", "content": "And Paris?"},
]


def history(request: dict[str, Any]) -> list[dict[str, Any]]:
    return template_messages(ChatCompletionRequest(model="m", **request).messages)


def test_calls_and_results_are_rewritten_for_any_template() -> None:
    messages = prompted_messages(history({"messages": HISTORY}), GENERIC, plan())
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools\n")
    assert messages[2]["content"] == ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
                                      '\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
                                      '{"city": "Oslo"}}\n</tool_call>')
    # Both results and the next question are one user turn: user and assistant still alternate.
    assert messages[3]["content"] == ("<tool_response>\n21 C\n</tool_response>\n"
                                      "<tool_response>\n3 C\n</tool_response>\nAnd Paris?")
    assert all(set(m) == {"role", "content"} for m in messages)


def test_without_a_system_message_the_prompt_is_one_or_goes_to_the_first_user_turn() -> None:
    messages = history({"messages": HISTORY[1:2]})
    with_system = prompted_messages(messages, GENERIC, plan())
    assert [m["role"] for m in with_system] == ["system", "user"]
    assert with_system[0]["content"].startswith("# Tools\n")
    folded = prompted_messages(messages, GENERIC, plan(), system=False)
    assert [m["role"] for m in folded] == ["user"]
    assert folded[0]["content"].startswith("# Tools\n") and folded[0]["content"].endswith("\n\nWeather in Rome and Oslo?")


def test_tool_choice_none_gets_no_prompt_but_keeps_the_history() -> None:
    messages = prompted_messages(history({"messages": HISTORY}), GENERIC, plan(tool_choice="none"))
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert "<tool_call>" in messages[2]["content"] and "<tool_response>" in messages[3]["content"]
    assert prompted_messages(history({"messages": HISTORY}), GENERIC, None) == messages
