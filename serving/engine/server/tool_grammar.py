"""The grammar that holds a reply to tool calls, for `tool_choice` `required` or a named function:
each call a JSON object `{"name": <one of the functions>, "<arguments key>": <its parameters'
schema>}`, written in the model family's wrapping (tool_parsers.Family), one call or (parallel
calls allowed, without a named function) one or more. The reply then always parses as calls.

The object is a JSON schema (anyOf one per function, the name a `const`) turned into EBNF by the
grammar library (serving.engine.guided's compact JSON, name first); the wrapping is literal text
around it. The functions' schema is held to the engine's compile budget first (nesting and size,
serving.engine.guided.check_schema_budget: a 400 `grammar_too_complex` naming `tools`), which keeps
its conversion under a second; built on a thread (the library's import takes seconds, and its
conversion lets go of the interpreter lock); the engine then compiles and caches it as any
`guided_grammar`, in the tenant's share of its pool and within its time budget.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from serving.engine.guided import GrammarBudget, GrammarError, check_schema_budget, json_schema_grammar, library_detail
from serving.engine.server.tool_parsers import Family

# The call's rule, renamed from the library's `root`; the library names its own rules root_* and basic_*.
_CALL_RULE = "loraplex_tool_call"
_ROOT_RULE = re.compile(r"^root ::= ", re.MULTILINE)
# A function without `parameters` takes none (OpenAI's reading): its arguments are `{}`.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def call_schema(function: dict[str, Any], args_key: str) -> dict[str, Any]:
    """The JSON schema of one call of `function` (an OpenAI function definition)."""
    parameters = function.get("parameters")
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, args_key: parameters or _NO_PARAMETERS},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def tool_call_grammar(family: Family, functions: Sequence[dict[str, Any]], *, parallel: bool,
                      budget: GrammarBudget | None = None) -> str:
    """EBNF (GBNF's syntax, `root` first) whose sentences are one call of one of `functions`, or
    several when `parallel`, in `family`'s wrapping. A parameters schema the library refuses
    raises GrammarError naming the construct (as a `guided_json` would); one past `budget`'s
    nesting or size (default: the engine's default budget), GrammarTooComplex."""
    import xgrammar as xgr

    schemas = [call_schema(function, family.args_key) for function in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    text = json.dumps(schema)
    check_schema_budget(schema, len(text.encode()), budget or GrammarBudget(), "the tools' parameters schema")
    try:
        # Property order is the schema's (name first), so a streamed call's name comes before its arguments.
        call_object = xgr.Grammar.from_ebnf(json_schema_grammar(text))
    except RuntimeError as exc:
        detail = library_detail(exc)
        names = ", ".join(function["name"] for function in functions)
        raise GrammarError(f"the parameters schema of {names} cannot be used to hold the reply to tool calls: "
                           f"{detail}") from exc
    parts = [_literal(family.grammar_open), call_object, _literal(family.grammar_close)]
    call = xgr.Grammar.concat(*[part for part in parts if part is not None])
    # concat renames the parts' roots (root_1, root_2, …): the only rule named root is the call's.
    call_rules = _ROOT_RULE.sub(f"{_CALL_RULE} ::= ", str(call), count=1)
    repeat = f" ({_quoted(family.grammar_separator)} {_CALL_RULE})*" if parallel else ""
    head = f"{_quoted(family.grammar_prefix)} " if family.grammar_prefix else ""
    tail = f" {_quoted(family.grammar_suffix)}" if family.grammar_suffix else ""
    return f"root ::= {head}{_CALL_RULE}{repeat}{tail}\n{call_rules}"


def _literal(text: str) -> Any:
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(f"root ::= {_quoted(text)}") if text else None


def _quoted(text: str) -> str:
    """An EBNF string literal of `text` (its escapes read as JSON's)."""
    return json.dumps(text)
