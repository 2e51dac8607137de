"""The EBNF grammar of a JSON schema's documents, as constrained decoding uses it: compact (no free
whitespace), its numbers bounded, so a model held to it cannot write one number forever.

xgrammar's conversion (``Grammar.from_json_schema``) lets a number's digits repeat without end: a
small model held to ``{"type": "number"}`` wrote ``1111111111111111222222…`` until ``max_tokens``
cut it into invalid JSON (issue 39, item 4). Its shared ``basic_*`` number rules (every number and
integer the schema leaves unbounded, and every number of an untyped or free-form part,
``json_object`` included) are rewritten here to the bounds ``MAX_*`` below; a schema's own bounds
(``minimum``/``maximum``, ``enum``) are the library's own rules and stay as written.

Strings are left as the library writes them: xgrammar 0.2.8 has no bounded string that is cheap
both to compile and to match at a real vocabulary's size (a bounded repetition of a character
class took 17 s to compile at 256 characters and 128k tokens, past the 5 s compile budget; of a
character rule, 1.3 s a token to mask), so a string the model never closes runs to
``max_tokens``, and the reply says so (server/incomplete.py). docs/tools-and-structured-output.md,
"Bounded JSON", gives the bounds and the figures (bench/json_grammar_bounds.py).

It imports only the grammar library (and that when called): the compiling processes
(serving.engine.grammar_worker) call it on their side.
"""

from __future__ import annotations

import re

# Integers below 10**15 are exact in a double; a double keeps about 16 significant digits and
# ends at 1e308.
MAX_INTEGER_DIGITS = 15
MAX_FRACTION_DIGITS = 15
MAX_EXPONENT_DIGITS = 3

# xgrammar 0.2.8 spells a length-bounded JSON string's character as [^"\\\r\n], which lets raw
# control characters (U+0000-U+001F) into the string: not JSON (RFC 8259), json.loads refuses it.
# Its unbounded strings exclude them; bounded ones are given the same class (no escapes, a subset).
_BOUNDED_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\]'

# The library's shared rules for numbers the schema leaves unbounded, as it writes them (one rule a
# line), and what each becomes.
_UNBOUNDED = {
    "basic_integer": '(("0") | (basic_integer_1 [1-9] [0-9]*))',
    "basic_number_2": '(("0") | ([1-9] [0-9]*))',
    "basic_number_3": '("" | ("." basic_number_digits{1, -1}))',
    "basic_number_5": '("" | ([eE] basic_number_4 basic_number_digits{1, -1}))',
}
_BOUNDED = {
    "basic_integer": f'(("0") | (basic_integer_1 [1-9] [0-9]{{0, {MAX_INTEGER_DIGITS - 1}}}))',
    "basic_number_2": f'(("0") | ([1-9] [0-9]{{0, {MAX_INTEGER_DIGITS - 1}}}))',
    "basic_number_3": f'("" | ("." basic_number_digits{{1, {MAX_FRACTION_DIGITS}}}))',
    "basic_number_5": f'("" | ([eE] basic_number_4 basic_number_digits{{1, {MAX_EXPONENT_DIGITS}}}))',
}
_RULE = re.compile(r"^(\w+) ::= (.*)$")


class UnexpectedGrammar(RuntimeError):
    """The library wrote its shared JSON rules differently from the version this was written for:
    bounding them blindly could change what they accept, so the constraint is refused instead."""


def json_schema_grammar(schema: str) -> str:
    """The EBNF grammar (GBNF's syntax) of compact JSON matching `schema` (its JSON text), with the
    module's bounds on the numbers the schema leaves unbounded. The library's RuntimeError for a
    schema it refuses passes through."""
    import xgrammar as xgr

    grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    return bound_json_rules(grammar.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))


def bound_json_rules(grammar: str) -> str:
    """`grammar` (the library's conversion of a schema) with its shared number rules bounded."""
    lines = []
    found: set[str] = set()
    for line in grammar.splitlines():
        rule = _RULE.match(line)
        if rule is None or rule.group(1) not in _UNBOUNDED:
            lines.append(line)
            continue
        name, body = rule.groups()
        if body != _UNBOUNDED[name]:
            raise UnexpectedGrammar(f"the grammar library writes {name} as {body!r}, not as this worker expects "
                                    f"({_UNBOUNDED[name]!r})")
        found.add(name)
        lines.append(f"{name} ::= {_BOUNDED[name]}")
    if found != set(_UNBOUNDED):
        missing = ", ".join(sorted(set(_UNBOUNDED) - found))
        raise UnexpectedGrammar(f"the grammar library's conversion has no rule {missing}")
    return "\n".join(lines) + "\n"
