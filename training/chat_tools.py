"""Tools in chat examples, in OpenAI's fine-tuning format: the line's `tools` (function
definitions), an assistant message's `tool_calls` and the `tool` messages that answer them.

Each check gives a Problem with a code in the style of OpenAI's format checker: `invalid_tools`
(not a list of `{"type": "function", "function": {"name", "description"?, "parameters"?}}`, a
name twice, parameters that are no JSON schema), `invalid_tool_calls` (a call's shape, or an id
used twice), `tool_call_unknown_function` (a call of a function the line's tools do not define),
`invalid_tool_call_arguments` (arguments that are not the JSON text of an object, or that do not
validate against the function's parameters) and `invalid_tool_message` (a tool message without
string content, or whose `tool_call_id` answers no earlier call). The calls are kept with their
arguments as objects, the form chat templates render (`tool_call.arguments | tojson`).

Validation never touches the network: a schema may reference only its own parts (`#/…`), a
remote `$ref` is that line's `invalid_tools` error, and the validators resolve references in a
registry that retrieves nothing (jsonschema's default fetched any URL a `$ref` named, from the
worker: SSRF, and a tarpit held the worker for minutes).
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
from referencing import Registry
from referencing.exceptions import Unresolvable

from training.problems import Problem

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# The keywords that reference another schema (2020-12, 2019-09 and the older drafts' $ref).
_REFERENCE_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")
# Resolves only what a schema holds (and the drafts' own meta-schemas, which jsonschema adds): no
# `retrieve`, so any other reference is Unresolvable instead of fetched.
_NO_RETRIEVAL = Registry()


def parse_tools(value: Any) -> tuple[tuple[dict[str, Any], ...], list[Problem]]:
    """The line's tools as OpenAI's tool objects, and what is wrong with them."""
    if not isinstance(value, list) or not value:
        return (), [Problem("invalid_tools", "'tools' must be a non-empty list of function tools.")]
    tools: list[dict[str, Any]] = []
    problems: list[Problem] = []
    names: set[str] = set()
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            problems.append(Problem("invalid_tools", f"{where} must be {{\"type\": \"function\", \"function\": "
                                                     "{\"name\", \"description\", \"parameters\"}}."))
            continue
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            problems.append(Problem("invalid_tools", f"{where}.function.name must be 1 to 64 letters, digits, "
                                                     f"'_' or '-', not {name!r}."))
            continue
        if name in names:
            problems.append(Problem("invalid_tools", f"{where} defines {name!r} again; each function needs a "
                                                     "name of its own."))
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not _is_schema(parameters):
            problems.append(Problem("invalid_tools", f"{where}.function.parameters is not a valid JSON schema."))
        elif (remote := _remote_reference(parameters)) is not None:
            problems.append(Problem("invalid_tools", f"{where}.function.parameters: remote $ref {remote!r} is not "
                                                     "allowed; only local '#/…' references are."))
        if "description" in function and not isinstance(function["description"], str):
            problems.append(Problem("invalid_tools", f"{where}.function.description must be a string."))
        tools.append({"type": "function", "function": function})
    return tuple(tools), problems


def _is_schema(value: Any) -> bool:
    if not isinstance(value, dict):
        return False
    try:
        jsonschema.validators.validator_for(value).check_schema(value)
    except jsonschema.SchemaError:
        return False
    return True


def _remote_reference(schema: Any) -> str | None:
    """The first reference in `schema` to anything but a part of itself (`#…`), or None. Iterative:
    the schema is as deep as its line, which only the JSON parser's recursion bound limits."""
    pending = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            for keyword in _REFERENCE_KEYWORDS:
                target = node.get(keyword)
                if isinstance(target, str) and not target.startswith("#"):
                    return target
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
    return None


def parse_tool_calls(value: Any, where: str, tools: tuple[dict[str, Any], ...],
                     call_ids: set[str]) -> tuple[list[dict[str, Any]], list[Problem]]:
    """An assistant message's calls (arguments as objects), adding their ids to `call_ids`."""
    if not isinstance(value, list) or not value:
        return [], [Problem("invalid_tool_calls", f"{where}.tool_calls must be a non-empty list of calls.")]
    functions = {tool["function"]["name"]: tool["function"] for tool in tools}
    calls: list[dict[str, Any]] = []
    problems: list[Problem] = []
    for index, call in enumerate(value):
        at = f"{where}.tool_calls[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(call, dict) or not isinstance(call.get("id"), str) or not call["id"]
                or call.get("type", "function") != "function" or not isinstance(function, dict)
                or not isinstance(function.get("name"), str) or not isinstance(function.get("arguments"), str)):
            if isinstance(call, dict) and isinstance(call.get("id"), str):
                call_ids.add(call["id"])  # its answer is not a second error
            problems.append(Problem("invalid_tool_calls", f"{at} must be {{\"id\": str, \"type\": \"function\", "
                                                          "\"function\": {\"name\": str, \"arguments\": str}}."))
            continue
        if call["id"] in call_ids:
            problems.append(Problem("invalid_tool_calls", f"{at} reuses the id {call['id']!r}; each call needs its own."))
        call_ids.add(call["id"])
        name = function["name"]
        if name not in functions:
            known = ", ".join(sorted(functions)) or "none: the line has no 'tools'"
            problems.append(Problem("tool_call_unknown_function",
                                    f"{at} calls {name!r}, which the line's tools do not define ({known})."))
            continue
        arguments, problem = _arguments(function["arguments"], at, functions[name].get("parameters"))
        if problem is not None:
            problems.append(problem)
            continue
        calls.append({"id": call["id"], "type": "function", "function": {"name": name, "arguments": arguments}})
    return calls, problems


def _arguments(text: str, at: str, parameters: dict[str, Any] | None) -> tuple[dict[str, Any], Problem | None]:
    try:
        arguments = json.loads(text)
    except ValueError as not_json:
        return {}, Problem("invalid_tool_call_arguments", f"{at}.function.arguments is not JSON ({not_json}).")
    if not isinstance(arguments, dict):
        return {}, Problem("invalid_tool_call_arguments",
                           f"{at}.function.arguments must be the JSON text of an object.")
    if parameters is not None:
        validator = jsonschema.validators.validator_for(parameters)(parameters, registry=_NO_RETRIEVAL)
        try:
            error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
        except Unresolvable as unresolvable:
            return {}, Problem("invalid_tool_call_arguments", f"{at}.function.arguments cannot be checked: the "
                                                              f"function's parameters have a $ref that does not "
                                                              f"resolve ({unresolvable}).")
        except RecursionError:
            return {}, Problem("invalid_tool_call_arguments", f"{at}.function.arguments cannot be checked: the "
                                                              "function's parameters refer to themselves without end.")
        if error is not None:
            return {}, Problem("invalid_tool_call_arguments", f"{at}.function.arguments do not match the function's "
                                                              f"parameters: {error.message}.")
    return arguments, None


def check_tool_message(message: dict[str, Any], where: str, call_ids: set[str]) -> list[Problem]:
    """What is wrong with a `tool` message: its content, or a tool_call_id answering no earlier call."""
    problems = []
    if not isinstance(message.get("content"), str):
        problems.append(Problem("invalid_tool_message", f"{where} is a tool message; its content (the tool's "
                                                        "result) must be a string."))
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or call_id not in call_ids:
        problems.append(Problem("invalid_tool_message", f"{where} has tool_call_id {call_id!r}, which answers no "
                                                        "call of an earlier assistant message."))
    return problems
