"""The bounded grammar of a JSON schema (serving.engine.json_grammar): the numbers the schema leaves
unbounded (its own, and those of a free-form object) stop at the documented bounds; a schema's own
bounds still hold; strings are the library's, escapes and all; a library that writes its shared
rules otherwise is refused rather than bounded blindly. Walked character by character through
xgrammar's matcher on the tiny model's vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from serving.engine.json_grammar import (
    MAX_EXPONENT_DIGITS,
    MAX_FRACTION_DIGITS,
    MAX_INTEGER_DIGITS,
    UnexpectedGrammar,
    bound_json_rules,
    json_schema_grammar,
)


@pytest.fixture(scope="module")
def compiler(tiny_llama_dir: Path) -> xgr.GrammarCompiler:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def matches(compiler: xgr.GrammarCompiler, schema: dict[str, Any], document: str) -> bool:
    """`document` is a whole sentence of `schema`'s bounded grammar."""
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(json_schema_grammar(json.dumps(schema))))
    return all(matcher.accept_string(char) for char in document) and matcher.is_completed()


def digits(count: int) -> str:
    return "".join(str(1 + i % 9) for i in range(count))


def test_a_numbers_integer_part_fraction_and_exponent_are_bounded(compiler: xgr.GrammarCompiler) -> None:
    number = {"type": "number"}
    longest = f"-{digits(MAX_INTEGER_DIGITS)}.{digits(MAX_FRACTION_DIGITS)}e+{digits(MAX_EXPONENT_DIGITS)}"
    assert matches(compiler, number, longest)
    assert json.loads(longest) < 0
    assert not matches(compiler, number, digits(MAX_INTEGER_DIGITS + 1))
    assert not matches(compiler, number, f"1.{digits(MAX_FRACTION_DIGITS + 1)}")
    assert not matches(compiler, number, f"1E{digits(MAX_EXPONENT_DIGITS + 1)}")
    # The reply: a model repeating digits is made to stop at the bound.
    assert not matches(compiler, {"type": "object", "properties": {"population_millions": number},
                                  "required": ["population_millions"]},
                       '{"population_millions": 1111111111111111222222}')
    for valid in ("0", "-0.5", "12", "3.25E-7"):
        assert matches(compiler, number, valid)


def test_an_integer_is_bounded_unless_the_schema_bounds_it(compiler: xgr.GrammarCompiler) -> None:
    assert matches(compiler, {"type": "integer"}, f"-{digits(MAX_INTEGER_DIGITS)}")
    assert not matches(compiler, {"type": "integer"}, digits(MAX_INTEGER_DIGITS + 1))
    assert not matches(compiler, {"type": "integer"}, "1.5")
    # The schema's own range is the library's rule, as written.
    ranged = {"type": "integer", "minimum": 10, "maximum": 20}
    assert matches(compiler, ranged, "15") and not matches(compiler, ranged, "25")


def test_strings_are_the_librarys_escapes_and_all(compiler: xgr.GrammarCompiler) -> None:
    # No default length bound (the module says why): every JSON escape, no raw control character.
    string = {"type": "string"}
    escaped = 'a "quoted" line\nand a tab\t, a \\ and \u00e9'
    assert matches(compiler, string, json.dumps(escaped))
    assert matches(compiler, string, json.dumps(escaped, ensure_ascii=False))
    assert matches(compiler, string, json.dumps("x" * 10_000))
    assert not matches(compiler, string, '"a\nb"')
    # A schema's maxLength is the library's bounded form, without raw control characters.
    short = {"type": "string", "maxLength": 3}
    assert matches(compiler, short, '"abc"') and not matches(compiler, short, '"abcd"')
    assert not matches(compiler, short, '"a\x01"')


def test_a_free_form_objects_numbers_are_bounded_too(compiler: xgr.GrammarCompiler) -> None:
    # json_object's grammar: any object, its values of any type.
    anything = {"type": "object"}
    assert matches(compiler, anything, '{"a": [1, {"b": "c", "d": null}], "e": -2.5}')
    assert matches(compiler, anything, '{"a": [1, {"b": ' + digits(MAX_INTEGER_DIGITS) + "}]}")
    assert not matches(compiler, anything, '{"a": [1, {"b": ' + digits(MAX_INTEGER_DIGITS + 1) + "}]}")


def test_a_library_that_writes_its_rules_otherwise_is_refused() -> None:
    grammar = str(xgr.Grammar.from_json_schema('{"type": "number"}', any_whitespace=False))
    assert "basic_number_digits{1, 15}" in bound_json_rules(grammar)
    changed = grammar.replace("basic_number_digits{1, -1}))\n", "basic_number_digits{1, -1}) | \"x\")\n", 1)
    with pytest.raises(UnexpectedGrammar, match="writes basic_number_3 as"):
        bound_json_rules(changed)
    with pytest.raises(UnexpectedGrammar, match="has no rule basic_integer"):
        bound_json_rules("\n".join(line for line in grammar.splitlines() if not line.startswith("basic_integer ")))
