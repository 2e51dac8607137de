"""bench/structured_output.py's schemas (bench/structured_schemas.py) do what the benchmark relies
on: they are valid strict schemas, the engine's grammar of each accepts the shortest document the
schema allows and nothing shorter (so a constrained sequence stays in the batch for the ``floor``
tokens the benchmark times), and each arriving schema is one the engine has never compiled."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bench.structured_schemas import Schema, arrival_schema, bench_schemas
from serving.engine.guided import GrammarCompiler, Guide, GuidedDecodingParams

FLOOR = 12
# A string each of the schemas' patterns matches (the shortest document needs one).
PATTERN_EXAMPLES = {"^[A-Z]{2}-[0-9]{6}$": "AB-123456", "^[a-z]+-[0-9]{4}$": "q-2026",
                    "^[A-Z]{3}-[0-9]{4}-[a-z]{2,8}$": "ABC-1234-xy"}
FORMS = [("base", i) for i in range(8)] + [("arrival", i) for i in range(8)]


def schema_of(form: str, index: int) -> Schema:
    schema = bench_schemas(FLOOR)[index]
    return arrival_schema(schema, "t1") if form == "arrival" else schema


def shortest(schema: Schema, *, fewer: bool = False) -> Any:
    """The shortest document `schema` allows; with `fewer`, its arrays one item short."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema["type"]
    if kind == "object":
        return {name: shortest(p, fewer=fewer) for name, p in schema["properties"].items()}
    if kind == "array":
        return [shortest(schema["items"], fewer=fewer)] * (schema.get("minItems", 0) - fewer)
    if kind == "string":
        return PATTERN_EXAMPLES.get(schema.get("pattern", ""), "")
    if kind == "boolean":
        return True
    return schema.get("minimum", 0)


def objects(schema: Schema) -> list[Schema]:
    found = [schema] if schema.get("type") == "object" else []
    for child in [*schema.get("properties", {}).values(), *([schema["items"]] if "items" in schema else [])]:
        found += objects(child)
    return found


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: PreTrainedTokenizerBase) -> Iterator[GrammarCompiler]:
    compiler = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id])
    yield compiler
    compiler.shutdown()  # its pool's processes


@pytest.mark.parametrize(("form", "index"), FORMS)
def test_each_schema_is_a_strict_schema(form: str, index: int) -> None:
    schema = schema_of(form, index)
    jsonschema.Draft202012Validator.check_schema(schema)
    for obj in objects(schema):
        assert obj["required"] == list(obj["properties"]) and obj["additionalProperties"] is False


@pytest.mark.e2e
@pytest.mark.parametrize(("form", "index"), FORMS)
def test_the_grammar_takes_the_shortest_document_and_nothing_shorter(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase, form: str, index: int,
) -> None:
    schema = schema_of(form, index)
    grammar = compiler.compile(GuidedDecodingParams(json=schema)).result()
    eos = tokenizer.eos_token_id
    # The engine's JSON: sorted properties (one spelling per schema), ", " and ": " between items.
    document = shortest(schema)
    jsonschema.validate(document, schema)
    tokens = tokenizer(json.dumps(document, sort_keys=True), add_special_tokens=False).input_ids
    assert len(tokens) >= FLOOR
    guide = Guide(grammar)
    assert all(guide.accept(t) for t in tokens)
    assert guide.accept(eos) and guide.is_terminated

    short = shortest(schema, fewer=True)
    with pytest.raises(jsonschema.ValidationError, match="should be non-empty|is too short"):
        jsonschema.validate(short, schema)
    guide = Guide(grammar)
    walked = all(guide.accept(t) for t in tokenizer(json.dumps(short, sort_keys=True), add_special_tokens=False).input_ids)
    assert not (walked and guide.accept(eos))


def test_arriving_schemas_are_new_to_the_engine() -> None:
    base = bench_schemas(FLOOR)
    keys = {GuidedDecodingParams(json=s).key for s in base}
    for tag in ("c0", "n0"):
        keys |= {GuidedDecodingParams(json=arrival_schema(s, tag)).key for s in base}
    assert len(keys) == 3 * len(base)
    assert GuidedDecodingParams(json=arrival_schema(base[0], "n0")).key == \
        GuidedDecodingParams(json=arrival_schema(base[0], "n0")).key
