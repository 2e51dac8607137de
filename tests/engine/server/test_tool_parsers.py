"""Tool calls read out of each model family's text (Hermes/Qwen2.5, Llama 3.x JSON, Mistral), whole
and fed in pieces (a stream reassembles to exactly the whole reply), malformed output left as
content; the family picked from the chat template; the grammar of required / named calls holds
each family's text and nothing else."""

from __future__ import annotations

import json

import pytest
from xgrammar.testing import _is_grammar_accept_string

from serving.engine.server.tool_grammar import tool_call_grammar
from serving.engine.server.tool_parsers import (
    GENERIC,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    Arguments,
    Call,
    CallStart,
    Content,
    Family,
    ToolCallParser,
    family_for,
    parse,
)
from serving.engine.server.tool_prompt import call_text
from serving.engine.tiny import CHAT_TEMPLATE

WEATHER = Call("get_weather", '{"city": "Rome", "days": [1, {"a": "}"}]}')
ORDER = Call("order_status", '{"order_id": 42}')

WELL_FORMED = [
    (HERMES, f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER.arguments}}}\n</tool_call>', None, [WEATHER]),
    (HERMES, f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER.arguments}}}\n</tool_call>\n'
             f'<tool_call>\n{{"name": "order_status", "arguments": {ORDER.arguments}}}\n</tool_call>',
     "Let me check.", [WEATHER, ORDER]),
    (LLAMA3_JSON, f'{{"name": "get_weather", "parameters": {WEATHER.arguments}}}', None, [WEATHER]),
    (LLAMA3_JSON, f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER.arguments}}}; '
                  f'{{"name": "order_status", "parameters": {ORDER.arguments}}}', None, [WEATHER, ORDER]),
    (MISTRAL, f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER.arguments}}}, '
              f'{{"name": "order_status", "arguments": {ORDER.arguments}}}]', None, [WEATHER, ORDER]),
    # The marker is a special token that skip_special_tokens drops: the array alone is the calls too.
    (MISTRAL, f' [{{"name": "order_status", "arguments": {ORDER.arguments}}}]', None, [ORDER]),
    (MISTRAL, f'Checking. [TOOL_CALLS][{{"name": "order_status", "arguments": {ORDER.arguments}}}]', "Checking.",
     [ORDER]),
    # Arguments written as a JSON string of the object, as some models do.
    (HERMES, '<tool_call>\n{"name": "order_status", "arguments": "{\\"order_id\\": 42}"}\n</tool_call>', None, [ORDER]),
    # The generic family (a template without a tool format: the worker's own prompt asks for these
    # blocks), as a model that follows the prompt loosely writes them: no newlines, text around.
    (GENERIC, f'I will look that up.\n<tool_call>{{"name": "get_weather", "arguments": {WEATHER.arguments}}}'
              f'</tool_call>\n\n<tool_call> {{"name": "order_status", "arguments": {ORDER.arguments}}} </tool_call>',
     "I will look that up.", [WEATHER, ORDER]),
    (GENERIC, f'<tool_call>\n{{"arguments": {ORDER.arguments}, "name": "order_status"}}\n</tool_call>', None, [ORDER]),
]

# A call without arguments: no object to hand over, so plain content (not a crash).
NO_ARGUMENTS = [
    (HERMES, '<tool_call>\n{"name": "get_weather"}\n</tool_call>'),
    (LLAMA3_JSON, '{"name": "get_weather"}'),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather"}]'),
]

MALFORMED = [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}\n</tool_call>'),  # unclosed
    (HERMES, '<tool_call>\n{"arguments": {"city": "Rome"}}\n</tool_call>'),  # no name
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>'),  # not an object
    (HERMES, '<tool_call> I would call {"name": "f", "arguments": {}} </tool_call>'),  # prose before the object
    (HERMES, 'I cannot help with <tool_c'),
    (LLAMA3_JSON, '{"answer": 42}'),
    (LLAMA3_JSON, 'Sure: {"name": "f", "parameters": {}}'),  # calls are the whole reply, or none
    (LLAMA3_JSON, '{"name": "f", "parameters": {}} and then some prose'),
    (MISTRAL, '[1, 2, 3]'),
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {}}'),  # the array never closes
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {"a": tru}}]'),  # not JSON
    # The generic family reads tagged blocks only: a reply that is JSON is an answer, not a call.
    (GENERIC, '{"name": "get_weather", "arguments": {"city": "Rome"}}'),
    (GENERIC, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"'),  # cut off
    *NO_ARGUMENTS,
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>\n'
             '<tool_call>\n{"name": "order_status"}\n</tool_call>'),  # one of two calls without: all content
]


def streamed(family: Family, text: str, size: int, *, parallel: bool = True) -> tuple[str, list[Call], list]:
    """(content, calls, events) as a stream delivering `text` in pieces of `size` characters gives them."""
    parser = ToolCallParser(family, parallel=parallel)
    events = []
    for start in range(0, len(text), size):
        events += parser.feed(text[start:start + size])
    events += parser.finish()
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for event in events:
        if isinstance(event, CallStart):
            assert event.index not in names and event.index not in arguments  # the name comes first, once
            names[event.index] = event.name
        elif isinstance(event, Arguments):
            arguments[event.index] = arguments.get(event.index, "") + event.text
    content = "".join(event.text for event in events if isinstance(event, Content))
    return content, [Call(names[i], arguments.get(i, "")) for i in sorted(names)], events


@pytest.mark.parametrize(("family", "text", "content", "calls"), WELL_FORMED)
def test_calls_of_each_family_whole_and_in_every_piece_size(family: Family, text: str, content: str | None,
                                                            calls: list[Call]) -> None:
    whole = parse(family, text)
    assert whole.content == content
    assert list(whole.calls) == calls
    for size in (1, 2, 3, 7, len(text)):
        got_content, got_calls, _ = streamed(family, text, size)
        assert (got_content or None, got_calls) == (content, calls), size


@pytest.mark.parametrize(("family", "text"), MALFORMED)
def test_malformed_calls_are_left_as_content(family: Family, text: str) -> None:
    whole = parse(family, text)
    assert whole.calls == () and whole.content == text


@pytest.mark.parametrize(("family", "text"), NO_ARGUMENTS)
def test_a_streamed_call_without_arguments_is_content(family: Family, text: str) -> None:
    for size in (1, 5, len(text)):
        assert streamed(family, text, size)[:2] == (text, []), size


def test_a_stream_sends_a_calls_arguments_as_they_come() -> None:
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER.arguments}}}\n</tool_call>'
    _, _, events = streamed(HERMES, text, 1)
    pieces = [event.text for event in events if isinstance(event, Arguments)]
    assert len(pieces) > 10 and "".join(pieces) == WEATHER.arguments
    assert isinstance(events[0], CallStart)


def test_without_parallel_calls_only_the_first_call_counts() -> None:
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "order_status", "arguments": {}}\n</tool_call>')
    assert parse(HERMES, text, parallel=False).calls == (Call("get_weather", "{}"),)
    assert streamed(HERMES, text, 3, parallel=False)[1] == [Call("get_weather", "{}")]
    llama = '{"name": "get_weather", "parameters": {}}; {"name": "order_status", "parameters": {}}'
    assert parse(LLAMA3_JSON, llama, parallel=False).calls == (Call("get_weather", "{}"),)


LLAMA31_TEMPLATE = ('{%- if tool_call %}{{- \'{"name": "\' + tool_call.name + \'", \' }}{{- \'"parameters": \' }}'
                    '{%- endif %}<|start_header_id|>assistant<|end_header_id|>')
MISTRAL_TEMPLATE = '{%- if message.tool_calls %}{{- "[TOOL_CALLS][" }}{%- endif %}'


@pytest.mark.parametrize(("choice", "template", "expected"), [
    ("auto", CHAT_TEMPLATE, HERMES),
    ("auto", LLAMA31_TEMPLATE, LLAMA3_JSON),
    ("auto", "{{ '<|python_tag|>' }}", LLAMA3_JSON),
    ("auto", MISTRAL_TEMPLATE, MISTRAL),
    # No format this worker reads: the generic one its own tool prompt asks for (tool_prompt.py).
    ("auto", "{% for m in messages %}{{ m.content }}{% endfor %}", GENERIC),
    ("auto", None, GENERIC),
    ("mistral", CHAT_TEMPLATE, MISTRAL),
    ("generic", CHAT_TEMPLATE, GENERIC),
    ("none", CHAT_TEMPLATE, None),
])
def test_the_family_is_the_flags_or_the_templates(choice: str, template: str | None, expected: Family | None) -> None:
    assert family_for(choice, template) is expected


FUNCTIONS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                           "required": ["city"], "additionalProperties": False}},
    {"name": "ping"},  # no parameters: its arguments are {}
]


@pytest.mark.parametrize("family", [HERMES, LLAMA3_JSON, MISTRAL, GENERIC])
def test_the_grammar_of_forced_calls_holds_the_familys_text(family: Family) -> None:
    one, two = [("get_weather", {"city": "Rome"})], [("get_weather", {"city": "Rome"}), ("ping", {})]
    parallel = tool_call_grammar(family, FUNCTIONS, parallel=True)
    single = tool_call_grammar(family, FUNCTIONS, parallel=False)
    named = tool_call_grammar(family, FUNCTIONS[1:], parallel=False)
    assert _is_grammar_accept_string(parallel, call_text(family, two))
    assert _is_grammar_accept_string(single, call_text(family, one))
    assert not _is_grammar_accept_string(single, call_text(family, two))
    assert _is_grammar_accept_string(named, call_text(family, [("ping", {})]))
    assert not _is_grammar_accept_string(named, call_text(family, one))
    assert not _is_grammar_accept_string(single, call_text(family, [("get_weather", {"town": "Rome"})]))
    assert not _is_grammar_accept_string(single, call_text(family, [("get_weather", {"city": 3})]))
    # What the grammar writes, the family's parser reads.
    assert [call.name for call in parse(family, call_text(family, two)).calls] == ["get_weather", "ping"]


@pytest.mark.parametrize("family", [HERMES, LLAMA3_JSON, MISTRAL])
def test_the_grammar_of_forced_calls_requires_the_arguments_and_their_required_fields(family: Family) -> None:
    """The grammar, not a sampled model, is what keeps a forced call whole: a call without its
    arguments object, or whose arguments lack a required parameter, is not a sentence of it."""
    single = tool_call_grammar(family, FUNCTIONS, parallel=False)
    no_arguments = json.dumps({"name": "get_weather"})
    text = f"{family.grammar_prefix}{family.grammar_open}{no_arguments}{family.grammar_close}{family.grammar_suffix}"
    assert not _is_grammar_accept_string(single, text)
    assert not _is_grammar_accept_string(single, call_text(family, [("get_weather", {})]))
    assert not _is_grammar_accept_string(tool_call_grammar(family, FUNCTIONS[1:], parallel=False),
                                         text.replace("get_weather", "ping"))
    assert _is_grammar_accept_string(single, call_text(family, [("get_weather", {"city": "Rome"})]))
    assert _is_grammar_accept_string(single, call_text(family, [("ping", {})]))
