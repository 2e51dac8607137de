"""The worker's own tool prompt, for a chat template that does not render tools or whose tool-call
format the worker does not read (tool_parsers.GENERIC): OpenAI's callers expect tools on any chat
model, so the worker writes the functions and the call format into the system prompt itself and
reads the reply in that format.

`is_prompted` says when: the family is GENERIC (the template writes no format this worker reads:
its own instructions would ask for calls the worker cannot read) or the template does not read
`tools`. Then the template gets no `tools=`, and `prompted_messages` rewrites the conversation into
messages any template renders: the tool prompt (`tool_prompt`) at the end of the first system
message, or as a system message of its own (or, for a template that refuses a system message, at
the head of the first user message: `system=False`); an assistant's calls as text in the format it
is asked to write; a tool's result as a user message `<tool_response>\n…\n</tool_response>`, joined
to the user message next to it, so templates that want user and assistant turns to alternate
render it. docs/tools-and-structured-output.md shows the prompt.

With `tool_choice: "none"` no tool prompt is written (the reply is not read for calls), but the
history is rewritten all the same, so earlier calls and results stay in the conversation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from serving.engine.server.tool_parsers import GENERIC, Family, reads_tools
from serving.engine.server.tool_requests import ToolPlan


def is_prompted(family: Family | None, chat_template: str | None) -> bool:
    """The worker, not the template, puts the tools and their calls into the prompt."""
    return family is not None and (family is GENERIC or not reads_tools(chat_template))


def call_text(family: Family, calls: Sequence[tuple[str, Any]]) -> str:
    """`calls` ((name, arguments)) written as `family` writes them, and as its grammar holds them
    (tool_grammar.py): compact JSON, name first."""
    objects = [family.grammar_open
               + json.dumps({"name": name, family.args_key: arguments}, ensure_ascii=False)
               + family.grammar_close for name, arguments in calls]
    return family.grammar_prefix + family.grammar_separator.join(objects) + family.grammar_suffix


def tool_prompt(plan: ToolPlan, family: Family) -> str:
    """The system prompt's part that offers `plan`'s functions and asks for calls in `family`'s form."""
    listed = "\n".join(json.dumps(function, ensure_ascii=False) for function in plan.functions)
    one = call_text(family, [("<function name>", "<arguments>")]).replace('"<arguments>"', "<arguments object>")
    if plan.choice == "named":
        duty = f"You must call the function {plan.named}, once."
    elif plan.choice == "required":
        duty = "You must call at least one of them." if plan.parallel else "You must call one of them, once."
    else:
        duty = "Call one only when it helps to answer; otherwise answer directly."
    form = f"To call a function, write exactly:\n{one}"
    if plan.parallel:
        two = call_text(family, [("<function name>", "<arguments>")] * 2).replace('"<arguments>"',
                                                                                  "<arguments object>")
        form += f"\nTo call several at once, write them one after the other:\n{two}"
    else:
        form += "\nCall at most one function in a reply."
    return (
        "# Tools\n\n"
        "You can call the functions below. Each is a JSON object: its name, what it does (description) and "
        "its arguments as a JSON schema (parameters).\n"
        f"{listed}\n\n"
        f"{duty}\n{form}\n"
        "The arguments object must be valid JSON that matches the function's parameters. Write nothing after "
        "your calls: their results come back in the next message, each as <tool_response>…</tool_response>."
    )


def prompted_messages(messages: list[dict[str, Any]], family: Family, plan: ToolPlan | None, *,
                      system: bool = True) -> list[dict[str, Any]]:
    """`messages` (tool_requests.template_messages') with the tools written in by the worker (module
    docstring); the tool prompt in a system message when `system`, else in the first user message."""
    rendered: list[dict[str, Any]] = []
    from_tool: list[bool] = []  # per rendered message: it holds a tool's result
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            content, role = f"<tool_response>\n{content}\n</tool_response>", "user"
        elif message.get("tool_calls"):
            calls = call_text(family, [(call["function"]["name"], call["function"]["arguments"])
                                       for call in message["tool_calls"]])
            content = f"{content}\n{calls}" if content else calls
        is_result = message["role"] == "tool"
        if rendered and role == "user" and rendered[-1]["role"] == "user" and (is_result or from_tool[-1]):
            rendered[-1]["content"] += f"\n{content}"
            from_tool[-1] = True
            continue
        rendered.append({"role": role, "content": content})
        from_tool.append(is_result)
    if plan is None or not plan.parses:
        return rendered
    prompt = tool_prompt(plan, family)
    if rendered and rendered[0]["role"] == "system":
        rendered[0]["content"] = f"{rendered[0]['content']}\n\n{prompt}" if rendered[0]["content"] else prompt
    elif system:
        rendered.insert(0, {"role": "system", "content": prompt})
    else:
        first_user = next((m for m in rendered if m["role"] == "user"), None)
        if first_user is None:
            rendered.insert(0, {"role": "user", "content": prompt})
        else:
            first_user["content"] = f"{prompt}\n\n{first_user['content']}"
    return rendered
