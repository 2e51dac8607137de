"""The JSON schemas bench/structured_output.py constrains its sequences with: eight of the kinds a
tenant sends (an order, a support ticket, a catalog, an event log, a survey, weather readings, a
time series, tool calls), in OpenAI's strict subset (every property required, no additional ones,
no string lengths; patterns, enums, number ranges and ``minItems`` allowed).

Each schema holds one array whose ``minItems`` makes the document at least ``floor`` tokens long,
so a constrained sequence cannot complete its grammar (and leave the batch) inside the measured
steps, whatever the random model samples. The count assumes a tokenizer whose tokens never mix
letters, digits and punctuation (byte-level BPE with GPT-2's or Llama 3's split, as the tiny
model's and the benchmark's 128k tokenizers are): then each property of an array item takes at
least two tokens of its own (its name, then the punctuation after it) and each scalar item two (its
value and the comma).

``arrival_schema`` makes the schema of a request arriving mid-run: one of these with every property
renamed (a key no cache holds) and a ``zone`` object added, whose name sorts last (the engine writes
properties in sorted order), so it comes after the long array and is never reached in a timed
window (the masks are those of the schema it came from), and whose length-bounded
string makes xgrammar's compilation slow (about half a second at a 128k vocabulary on the
development CPU): a compilation that spans many engine steps, as a tenant's pydantic model with
``max_length`` fields does.
"""

from __future__ import annotations

import math
from typing import Any

Schema = dict[str, Any]

_STR: Schema = {"type": "string"}


def _object(**properties: Schema) -> Schema:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _enum(*values: str) -> Schema:
    return {"type": "string", "enum": list(values)}


def _tokens_per_item(item: Schema) -> int:
    """The fewest tokens one array item takes (module docstring): two per property, nested ones
    included, or two for a scalar."""
    if item.get("type") != "object":
        return 2
    return sum(2 + (_tokens_per_item(p) if p.get("type") == "object" else 0) for p in item["properties"].values())


def _long_array(item: Schema, floor: int) -> Schema:
    return {"type": "array", "items": item, "minItems": math.ceil(floor / _tokens_per_item(item))}


def bench_schemas(floor: int) -> list[Schema]:
    """The eight schemas, each of whose documents is at least `floor` tokens long."""
    return [
        _object(
            order_id={"type": "string", "pattern": "^[A-Z]{2}-[0-9]{6}$"},
            customer=_object(name=_STR, email=_STR),
            items=_long_array(_object(sku=_STR, quantity={"type": "integer", "minimum": 1}, price={"type": "number"}),
                              floor),
            status=_enum("pending", "shipped", "delivered", "cancelled"),
            gift={"type": "boolean"},
        ),
        _object(
            ticket={"type": "integer", "minimum": 1},
            priority=_enum("low", "normal", "high", "urgent"),
            summary=_STR,
            steps=_long_array(_object(action=_STR, succeeded={"type": "boolean"}), floor),
        ),
        _object(products=_long_array(_object(
            name=_STR, category=_enum("books", "garden", "kitchen", "toys"), price={"type": "number", "minimum": 0},
            in_stock={"type": "boolean"},
        ), floor)),
        _object(
            service=_STR,
            events=_long_array(_object(ts={"type": "integer"}, level=_enum("debug", "info", "warn", "error"),
                                       message=_STR), floor),
        ),
        _object(
            survey={"type": "string", "pattern": "^[a-z]+-[0-9]{4}$"},
            answers=_long_array(_object(question={"type": "integer", "minimum": 1},
                                        score={"type": "integer", "minimum": 1, "maximum": 5}, comment=_STR), floor),
        ),
        _object(
            station=_STR,
            readings=_long_array(_object(hour={"type": "integer", "minimum": 0, "maximum": 23},
                                         celsius={"type": "number"}, rain={"type": "boolean"}), floor),
        ),
        _object(unit=_enum("ms", "bytes", "requests"), values=_long_array({"type": "number"}, floor)),
        _object(calls=_long_array(_object(
            name=_enum("search", "lookup", "book"),
            arguments=_object(query=_STR, limit={"type": "integer", "minimum": 1, "maximum": 50}),
        ), floor)),
    ]


_ZONE = _object(name={"type": "string", "maxLength": 24},
                code={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}-[a-z]{2,8}$"})


def arrival_schema(schema: Schema, tag: str) -> Schema:
    """`schema` with ``zone`` added and every property renamed ``<name>_<tag>`` (``tag``: letters
    and digits): the same length floor, under a key no cache holds."""
    return _renamed(_object(**schema["properties"], zone=_ZONE), tag)


def _renamed(schema: Schema, tag: str) -> Schema:
    renamed = dict(schema)
    if "properties" in schema:
        renamed["properties"] = {f"{name}_{tag}": _renamed(p, tag) for name, p in schema["properties"].items()}
        renamed["required"] = [f"{name}_{tag}" for name in schema["required"]]
    if "items" in schema:
        renamed["items"] = _renamed(schema["items"], tag)
    return renamed
