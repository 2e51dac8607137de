"""What the tool-calling tests share: two tools with their schemas, a question for them, and how a
reply's calls are read and checked (tests/engine/server/test_tools.py on a template with a tool
format, test_generic_tools.py on one without)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai

MESSAGES = [{"role": "user", "content": "What is the weather in Rome?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    }, "required": ["city", "unit"], "additionalProperties": False}}}
ORDER = {"type": "function", "function": {
    "name": "order_status",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "integer", "minimum": 1, "maximum": 99999}},
                   "required": ["order_id"], "additionalProperties": False}}}
TOOLS = [WEATHER, ORDER]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


def regex_of(text: str) -> str:
    """A regex that holds a reply to exactly ``text`` (its dots and braces escaped)."""
    return text.replace(".", r"\.").replace("{", r"\{").replace("}", r"\}")


def calls_of(message: Any) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


def assert_valid_calls(message: Any, names: set[str]) -> None:
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(api: openai.OpenAI, args: dict[str, Any]) -> Any:
    """The reply as the SDK's own stream helper reassembles it from the chunks."""
    with api.chat.completions.stream(**args) as stream:
        for _ in stream:
            pass
        return stream.get_final_completion().choices[0]
