"""The request caps both the gateway and the worker apply (serving.contracts.request_caps): the
decoder's refusals (non-finite numbers, nesting past the bound, measured without recursion) and
each field's cap, refused with the field named; bodies within the caps pass untouched."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.contracts import request_caps as caps
from serving.contracts.request_caps import CapExceeded, check_caps, loads, too_deep


def refused(body: dict) -> CapExceeded:
    with pytest.raises(CapExceeded) as caught:
        check_caps(body)
    return caught.value


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize("text,param,literal", [
    ('{"temperature": NaN}', "temperature", "NaN"),
    ('{"logit_bias": {"5": Infinity}}', "logit_bias.5", "Infinity"),
    ('{"messages": [{"content": "x"}, {"n": -Infinity}]}', "messages[1].n", "-Infinity"),
    ('{"top_p": 1e400}', "top_p", "1e400"),
    ("NaN", None, "NaN"),
])
def test_non_finite_numbers_are_refused_naming_the_field(text: str, param: str | None, literal: str) -> None:
    with pytest.raises(CapExceeded) as caught:
        loads(text)
    assert caught.value.code == caps.NON_FINITE_NUMBER and caught.value.param == param
    assert literal in caught.value.message


def test_finite_numbers_and_their_look_alikes_pass() -> None:
    assert loads('{"t": 1e300, "s": "NaN Infinity", "u": -0.0, "v": 12}') == {"t": 1e300, "s": "NaN Infinity",
                                                                              "u": -0.0, "v": 12}
    assert loads(json.dumps({"t": 0.5}).encode("utf-16")) == {"t": 0.5}  # bytes: any encoding JSON allows


def test_nesting_past_the_bound_is_refused_without_recursion() -> None:
    assert not too_deep(json.dumps(nested(caps.MAX_JSON_DEPTH)))
    assert too_deep(json.dumps(nested(caps.MAX_JSON_DEPTH + 1)))
    for text in (json.dumps(nested(caps.MAX_JSON_DEPTH + 1)), "[" * 100_000 + "]" * 100_000, "[" * 100_000,
                 '{"a":' * 100_000 + "1" + "}" * 100_000):
        with pytest.raises(CapExceeded) as caught:
            loads(text)
        assert caught.value.code == caps.NESTING_TOO_DEEP and str(caps.MAX_JSON_DEPTH) in caught.value.message


def test_brackets_inside_strings_are_text_not_nesting() -> None:
    body = {"a": "[" * 500, "b": ["\\\"[" * 100, "\\", '"{{{']}
    assert not too_deep(json.dumps(body))
    assert loads(json.dumps(body)) == body
    # A string ending in an escaped backslash closes there: the brackets after it are nesting.
    deep = '{"a": "x\\\\", "b": ' + json.dumps(nested(caps.MAX_JSON_DEPTH)) + "}"
    assert too_deep(deep)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=40))
@settings(max_examples=300, deadline=None)
@pytest.mark.slow
def test_the_measured_depth_is_the_decoded_depth(value: object) -> None:
    def depth(item: object) -> int:
        if isinstance(item, dict):
            return 1 + max(map(depth, item.values()), default=0)
        if isinstance(item, list):
            return 1 + max(map(depth, item), default=0)
        return 0

    text = json.dumps(value)
    for bound in (1, 2, 3, 5):
        assert too_deep(text, bound) == (depth(value) > bound)


@pytest.mark.parametrize("body,param,bound", [
    ({"model": "m" * (caps.MAX_MODEL_CHARS + 1)}, "model", caps.MAX_MODEL_CHARS),
    ({"stop": ["x"] * 95_000}, "stop", caps.MAX_STOP_STRINGS),
    ({"stop": "s" * (caps.MAX_STOP_CHARS + 1)}, "stop", caps.MAX_STOP_CHARS),
    ({"stop": ["ok", "s" * (caps.MAX_STOP_CHARS + 1)]}, "stop", caps.MAX_STOP_CHARS),
    ({"stop_token_ids": list(range(caps.MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids", caps.MAX_STOP_TOKEN_IDS),
    ({"logit_bias": {str(i): 1 for i in range(caps.MAX_LOGIT_BIAS + 1)}}, "logit_bias", caps.MAX_LOGIT_BIAS),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(19_000)]}, "tools",
     caps.MAX_TOOLS),
    ({"functions": [{"name": f"f{i}"} for i in range(caps.MAX_TOOLS + 1)]}, "functions", caps.MAX_TOOLS),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"description": "d" * 40_000}}}]},
     "tools[0].function.parameters", caps.MAX_TOOL_SCHEMA_CHARS),
    ({"guided_choice": ["c"] * (caps.MAX_GUIDED_CHOICES + 1)}, "guided_choice", caps.MAX_GUIDED_CHOICES),
    ({"guided_choice": ["c" * (caps.MAX_GUIDED_CHOICE_CHARS + 1)]}, "guided_choice", caps.MAX_GUIDED_CHOICE_CHARS),
    ({"guided_regex": "a" * (caps.MAX_GUIDED_REGEX_CHARS + 1)}, "guided_regex", caps.MAX_GUIDED_REGEX_CHARS),
    ({"guided_grammar": "a" * (caps.MAX_GUIDED_GRAMMAR_CHARS + 1)}, "guided_grammar", caps.MAX_GUIDED_GRAMMAR_CHARS),
    ({"guided_json": {"description": "d" * caps.MAX_JSON_SCHEMA_CHARS}}, "guided_json", caps.MAX_JSON_SCHEMA_CHARS),
    ({"guided_json": json.dumps(nested(caps.MAX_JSON_DEPTH + 1))}, "guided_json", caps.MAX_JSON_DEPTH),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "description": "d" * caps.MAX_JSON_SCHEMA_CHARS}}}}, "response_format.json_schema.schema",
     caps.MAX_JSON_SCHEMA_CHARS),
])
def test_each_cap_refuses_naming_its_field_and_bound(body: dict, param: str, bound: int) -> None:
    error = refused(body)
    assert error.param == param and f"at most {bound}" in error.message, error.message


def test_bodies_at_the_caps_pass() -> None:
    check_caps({
        "model": "m" * caps.MAX_MODEL_CHARS,
        "stop": ["s" * caps.MAX_STOP_CHARS] * caps.MAX_STOP_STRINGS,
        "stop_token_ids": list(range(caps.MAX_STOP_TOKEN_IDS)),
        "logit_bias": {str(i): 1 for i in range(caps.MAX_LOGIT_BIAS)},
        "tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
                  for i in range(caps.MAX_TOOLS)],
        "guided_choice": ["c" * caps.MAX_GUIDED_CHOICE_CHARS] * caps.MAX_GUIDED_CHOICES,
        "guided_regex": "a" * caps.MAX_GUIDED_REGEX_CHARS,
        "guided_grammar": "a" * caps.MAX_GUIDED_GRAMMAR_CHARS,
        "guided_json": json.dumps(nested(caps.MAX_JSON_DEPTH)),
    })


def test_fields_of_the_wrong_type_are_left_to_each_sides_validation() -> None:
    check_caps({"stop": 5, "tools": "x", "functions": [1, None], "logit_bias": [], "guided_choice": "abc",
                "response_format": {"json_schema": "x"}, "model": None})
