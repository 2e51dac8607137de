"""A chat request's tools, checked and put in the shapes the chat template and the reply need.

`tool_plan` reads `tools` / `tool_choice` / `parallel_tool_calls`, or the legacy `functions` /
`function_call` (the reply then carries its one call as `function_call`), and refuses with a 400
naming the field what cannot be honoured: both spellings at once, two functions of one name,
`required` or a named function without tools, a named function not among them, or tools on a
worker whose operator turned tool calls off (`--tool-call-parser none`). A model whose template
writes no tool format the worker reads gets the generic one (tool_prompt.py), not a 400.

`template_messages` turns the history into `apply_chat_template`'s messages (Hugging Face's
convention): an assistant's `tool_calls` (or legacy `function_call`) with their arguments as
objects, a `tool` message with its `tool_call_id`, a legacy `function` message as a `tool` one. A
call's arguments that are not a JSON object, a call on a message that is not the assistant's, or a
tool message answering no earlier call are 400s naming the message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from serving.engine.server.errors import bad_request
from serving.contracts.protocol import (
    CalledFunction,
    ChatCompletionRequest,
    ChatMessage,
    FunctionName,
    MessageToolCall,
    NamedToolChoice,
)
from serving.engine.server.tool_parsers import Family

# OpenAI's `developer` role is what chat templates call `system`; `function` is the legacy `tool`.
_ROLE_ALIASES = {"developer": "system", "function": "tool"}


@dataclass(frozen=True)
class ToolPlan:
    """What the request's tools ask of this reply. `choice`: auto, none, required or named (then
    `named` is the function). `field`: the request's field that chose, for errors."""

    functions: tuple[dict[str, Any], ...]
    choice: str
    named: str | None
    parallel: bool
    legacy: bool
    field: str

    @property
    def parses(self) -> bool:
        """The reply is read for calls (tools offered and not `none`)."""
        return bool(self.functions) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """The reply must be calls: held to their grammar."""
        return self.choice in ("required", "named")

    def callable_functions(self) -> list[dict[str, Any]]:
        """The functions the reply may call (the named one only, when one is named)."""
        return [f for f in self.functions if self.named is None or f["name"] == self.named]

    def template_tools(self) -> list[dict[str, Any]]:
        """`tools=` for apply_chat_template: OpenAI's tool objects, as Hugging Face templates read them."""
        return [{"type": "function", "function": function} for function in self.functions]


def tool_plan(body: ChatCompletionRequest, family: Family | None) -> ToolPlan | None:
    """The request's tools for a model whose calls are written as `family` (None: tool calls off)."""
    if body.tools is not None and body.functions is not None:
        raise bad_request("Send tools or the legacy functions, not both.", param="functions")
    legacy = body.functions is not None
    definitions = body.functions if legacy else [tool.function for tool in body.tools or []]
    field = "function_call" if legacy else "tool_choice"
    functions = tuple(definition.model_dump(exclude_none=True) for definition in definitions or [])
    names = [function["name"] for function in functions]
    # One pass with a set: names.count per name was quadratic in the tools (19,000 held the loop 13 s).
    seen: set[str] = set()
    repeated: set[str] = set()
    for name in names:
        (repeated if name in seen else seen).add(name)
    duplicates = sorted(repeated)
    if duplicates:
        raise bad_request(f"{'functions' if legacy else 'tools'} define {', '.join(duplicates)} more than once; "
                          "each function needs a name of its own.", param="functions" if legacy else "tools")
    choice, named = _choice(body.function_call if legacy else body.tool_choice)
    if choice == "required" and legacy:
        raise bad_request("function_call takes none, auto or {\"name\": …}.", param=field)
    if choice in ("required", "named") and not functions:
        raise bad_request(f"{field} {choice!r} needs {'functions' if legacy else 'tools'} to call.", param=field)
    if named is not None and named not in names:
        raise bad_request(f"{field} names the function {named!r}, which is not among the "
                          f"{'functions' if legacy else 'tools'} ({', '.join(names)}).", param=field)
    if not functions:
        return None
    plan = ToolPlan(functions=functions, choice=choice, named=named, legacy=legacy, field=field,
                    parallel=not legacy and body.parallel_tool_calls is not False and named is None)
    if plan.parses and family is None:
        raise bad_request(
            f"This worker's operator turned tool calls off (--tool-call-parser none), so replies are not read "
            f"for calls; send {field} 'none' for a plain reply.", param=field)
    return plan


def _choice(value: str | NamedToolChoice | FunctionName | None) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if isinstance(value, str):
        return value, None
    if isinstance(value, NamedToolChoice):
        return "named", value.function.name
    return "named", value.name  # legacy {"name": …}


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The history as apply_chat_template's messages (module docstring); 400 naming a bad message."""
    rendered: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for index, message in enumerate(messages):
        role = _ROLE_ALIASES.get(message.role, message.role)
        item: dict[str, Any] = {"role": role, "content": message.text()}
        calls = message.tool_calls or []
        if message.function_call is not None:
            calls = [*calls, _legacy_call(message.function_call, index)]
        if calls:
            if role != "assistant":
                raise bad_request(f"messages[{index}] is a {message.role} message; only assistant messages make "
                                  "tool calls.", param=f"messages[{index}].tool_calls")
            item["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name,
                              "arguments": _arguments(call.function, f"messages[{index}].tool_calls[{number}]")}}
                for number, call in enumerate(calls)]
            call_ids.update(call.id for call in calls)
        if message.role == "tool":
            if message.tool_call_id is None or message.tool_call_id not in call_ids:
                raise bad_request(
                    f"messages[{index}] is a tool message whose tool_call_id ({message.tool_call_id!r}) answers no "
                    "call of an earlier assistant message.", param=f"messages[{index}].tool_call_id")
            item["tool_call_id"] = message.tool_call_id
        if message.role == "function":
            if not message.name:
                raise bad_request(f"messages[{index}] is a function message without the function's name.",
                                  param=f"messages[{index}].name")
            item["name"] = message.name
        rendered.append(item)
    return rendered


def _legacy_call(function_call: CalledFunction, index: int) -> MessageToolCall:
    return MessageToolCall(id=f"call_legacy_{index}", function=function_call)


def _arguments(function: CalledFunction, where: str) -> dict[str, Any]:
    """A call's arguments as the object templates render (`tool_call.arguments | tojson`)."""
    try:
        arguments = json.loads(function.arguments)
    except ValueError as exc:
        raise bad_request(f"{where}.function.arguments is not JSON ({exc}); it must be the JSON text of an object.",
                          param=f"{where}.function.arguments") from exc
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}.function.arguments must be the JSON text of an object.",
                          param=f"{where}.function.arguments")
    return arguments
