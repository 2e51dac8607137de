"""Structured output on the engine (serving.engine.guided): the tiny random model's free output is
garbage, so an output that always parses and validates shows the grammar's mask at work; free
sequences beside constrained ones, with and without adapters, keep their greedy tokens exactly."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import pytest

from serving.engine import LLM, LoRARequest, SamplingParams
from serving.engine.guided import GrammarError, GuidedDecodingParams

pytestmark = pytest.mark.usefixtures("one_thread")

# Every string and array bounded: a random model inside an unbounded string rarely closes it.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "active": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "active", "address"],
    "additionalProperties": False,
}
PROMPTS = ["The quick brown fox", "Hello! How are you today?", "Once upon a time"]


@pytest.fixture(scope="module")
def adapter(tiny_llama_dir: Path, make_adapter: Callable[..., Path]) -> LoRARequest:
    return LoRARequest("guided-a", str(make_adapter(tiny_llama_dir, r=8, seed=5, init_scale=0.5)))


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> Iterator[LLM]:
    llm = LLM(str(tiny_llama_dir), max_loras=2, max_lora_rank=8, device="cpu", max_model_len=512, num_kv_blocks=128)
    yield llm
    llm.llm_engine.shutdown()  # its grammar pool's processes


def constrained(guided: GuidedDecodingParams, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=200, guided_decoding=guided, **kwargs)  # type: ignore[arg-type]


@pytest.mark.e2e
def test_json_schema_output_always_validates(llm: LLM) -> None:
    guided = GuidedDecodingParams(json=SCHEMA)
    params = [constrained(guided, temperature=0)] + [constrained(guided, temperature=1.0, seed=s) for s in range(8)]
    outputs = llm.generate([PROMPTS[i % 3] for i in range(len(params))], params)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    # Sampling is not a constant: the seeds give different documents.
    assert len({o.outputs[0].text for o in outputs}) > 1


def test_unconstrained_output_is_not_json(llm: LLM) -> None:
    # The check above means something only if the model left alone does not write such JSON.
    text = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].text
    with pytest.raises(ValueError):
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.e2e
def test_json_object_regex_choice_and_grammar(llm: LLM) -> None:
    regex = r"[a-z]{3,6}@[a-z]{2,5}\.(com|org)"
    choices = ["yes", "no", 'maybe "so"']
    outputs = llm.generate(PROMPTS * 3, [
        constrained(GuidedDecodingParams(regex=regex), temperature=1.0, seed=1),
        constrained(GuidedDecodingParams(choice=choices), temperature=1.0, seed=2),
        constrained(GuidedDecodingParams(grammar='root ::= "(" [0-9]{1,4} ")"'), temperature=0),
        constrained(GuidedDecodingParams(regex=regex), temperature=0),
        constrained(GuidedDecodingParams(choice=choices), temperature=0),
        # Any object's keys are free strings, which this random model left greedy never closes;
        # this seed's draws close the object.
        constrained(GuidedDecodingParams(json_object=True), temperature=1.0, seed=0),
        constrained(GuidedDecodingParams(choice=choices), temperature=1.0, seed=3),
        constrained(GuidedDecodingParams(choice=choices), temperature=1.0, seed=4),
        constrained(GuidedDecodingParams(regex=regex), temperature=1.0, seed=5),
    ])
    texts = [o.outputs[0].text for o in outputs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs), texts
    for text in (texts[0], texts[3], texts[8]):
        assert re.fullmatch(regex, text), text
    for text in (texts[1], texts[4], texts[6], texts[7]):
        assert text in choices
    assert re.fullmatch(r"\([0-9]{1,4}\)", texts[2])
    assert isinstance(json.loads(texts[5]), dict)


@pytest.mark.slow
def test_free_neighbours_keep_their_greedy_tokens(llm: LLM, adapter: LoRARequest) -> None:
    """Constrained and free sequences of the base model and an adapter in one batch: the free ones'
    tokens are those of the same requests run without the constrained ones."""
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    free_loras = [None, adapter, None]
    alone = llm.generate(PROMPTS, [free] * 3, free_loras)
    guided = GuidedDecodingParams(json=SCHEMA)
    mixed = llm.generate(
        PROMPTS + PROMPTS,
        [free] * 3 + [constrained(guided, temperature=0), constrained(guided, temperature=0.7, seed=3),
                      constrained(GuidedDecodingParams(choice=["left", "right"]), temperature=0)],
        free_loras + [adapter, None, adapter],
    )
    for before, after in zip(alone, mixed[:3]):
        assert after.outputs[0].token_ids == before.outputs[0].token_ids
    for output in mixed[3:5]:
        jsonschema.validate(json.loads(output.outputs[0].text), SCHEMA)
    assert mixed[5].outputs[0].text in ("left", "right")


@pytest.mark.parametrize(("guided", "construct"), [
    (GuidedDecodingParams(json={"type": "frobnicate"}), 'Unsupported type "frobnicate"'),
    (GuidedDecodingParams(json={"type": "string", "pattern": "(?<=a)b"}), "Lookbehind is not supported"),
    (GuidedDecodingParams(regex="a{2,"), "Invalid repetition count"),
])
def test_a_grammar_the_library_refuses_names_the_construct(llm: LLM, guided: GuidedDecodingParams, construct: str) -> None:
    for _ in range(2):  # compiled, then refused again from the cache
        with pytest.raises(GrammarError, match=re.escape(construct)):
            llm.generate(PROMPTS[0], constrained(guided, temperature=0))
    # The engine goes on serving.
    assert llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids


def test_a_grammar_that_dead_ends_mid_output_fails_its_request_alone(llm: LLM) -> None:
    """`x` needs itself first, so after "a" nothing is allowed: the request fails with the caller's
    GrammarError (a 400 at HTTP, not the engine's "sampled outside the grammar" 500) and its free
    neighbour in the same batch is served as alone."""
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], free)[0].outputs[0].token_ids
    engine = llm.llm_engine
    engine.add_request("dead", PROMPTS[0], constrained(GuidedDecodingParams(grammar='root ::= "a" x\nx ::= x "b"'),
                                                       temperature=0))
    engine.add_request("free", PROMPTS[1], free)
    ended = {}
    while engine.has_unfinished_requests():
        ended.update({out.request_id: out for out in engine.step() if out.finished})
    assert isinstance(ended["dead"].error, GrammarError)
    assert "allows no token and cannot end" in str(ended["dead"].error)
    assert ended["free"].outputs[0].token_ids == alone


@pytest.mark.parametrize(("fields", "message"), [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1, 2]}, "is an object"),
    ({"choice": []}, "non-empty list"),
    ({"regex": ""}, "non-empty string"),
])
def test_malformed_constraints_are_refused_at_once(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GuidedDecodingParams(**fields)  # type: ignore[arg-type]


def test_equal_schemas_share_one_key() -> None:
    a = GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    b = GuidedDecodingParams(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}')
    assert a.key == b.key


def test_ignore_eos_with_a_constraint_is_refused() -> None:
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, guided_decoding=GuidedDecodingParams(regex="a+"))
