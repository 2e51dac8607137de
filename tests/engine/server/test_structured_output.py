"""Structured output through the official `openai` client on a real worker: `response_format`
(json_schema, json_object) on chat and vLLM's guided_* fields on both endpoints, streamed and not;
a schema the grammar library refuses, two constraints at once or a malformed one are 400s naming
the field and the construct; a number the model would repeat forever is closed at the grammar's
bound, and a structured reply cut by max_tokens carries incomplete_details."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from serving.engine.json_grammar import MAX_EXPONENT_DIGITS, MAX_FRACTION_DIGITS, MAX_INTEGER_DIGITS
from serving.engine.server.cli import ServerArgs
from tests.engine.server.conftest import WorkerProcess, serve_in_process

BASE = "tiny-base"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe Rome as JSON."}]
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}


def client(worker: WorkerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("model", [BASE, "alpha"])
def test_json_schema_reply_validates_streamed_and_not(worker: WorkerProcess, model: str) -> None:
    api = client(worker)
    for seed in range(2):
        args = dict(model=model, messages=MESSAGES, max_tokens=120, temperature=1.0, seed=seed,
                    response_format=JSON_SCHEMA_FORMAT)
        reply = api.chat.completions.create(**args)  # type: ignore[call-overload]
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in api.chat.completions.create(**args, stream=True)
                           if chunk.choices)
        assert streamed == reply.choices[0].message.content


def test_json_object_and_guided_fields(worker: WorkerProcess) -> None:
    api = client(worker)
    # Any object's keys are free strings, which this random model left greedy never closes; this
    # seed's draws close the object.
    obj = api.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=200, temperature=1.0, seed=0,
                                      response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    choices = ["positive", "negative", "neutral"]
    for seed in range(3):
        picked = api.completions.create(model="alpha", prompt="The review was", max_tokens=10, temperature=1.0, seed=seed,
                                        extra_body={"guided_choice": choices})
        assert picked.choices[0].text in choices
    regex = r"[A-Z][a-z]{2,8}, [0-9]{4}"
    chunks = api.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=30, temperature=0, stream=True,
                                         extra_body={"guided_regex": regex})
    assert re.fullmatch(regex, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    grammar = api.completions.create(model=BASE, prompt="Answer:", max_tokens=10, temperature=0,
                                     extra_body={"guided_grammar": 'root ::= ("yes" | "no") "."'})
    assert grammar.choices[0].text in ("yes.", "no.")


def test_a_number_the_model_would_write_forever_is_closed_at_its_bound(worker: WorkerProcess,
                                                                      tiny_model: Path) -> None:
    # Issue 39, item 4: a model that favours one digit wrote 1111111111111111222222… until max_tokens,
    # cut into invalid JSON. The bias here makes "1" this model's every choice the grammar allows.
    one = AutoTokenizer.from_pretrained(tiny_model).convert_tokens_to_ids("1")
    schema = {"type": "object", "properties": {"population_millions": {"type": "number"}},
              "required": ["population_millions"], "additionalProperties": False}
    args = dict(model=BASE, messages=MESSAGES, max_tokens=200, temperature=0, logit_bias={str(one): 100},
                response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}})
    choice = client(worker).chat.completions.create(**args).choices[0]  # type: ignore[call-overload]
    assert choice.finish_reason == "stop" and "incomplete_details" not in choice.model_extra
    number = re.fullmatch(r'\{"population_millions": (-?[0-9]+)(\.[0-9]+)?([eE][+-]?[0-9]+)?\}', choice.message.content)
    assert number is not None, choice.message.content
    integer, fraction, exponent = (group or "" for group in number.groups())
    assert len(integer.lstrip("-")) <= MAX_INTEGER_DIGITS and len(fraction) <= MAX_FRACTION_DIGITS + 1
    assert len(exponent.lstrip("eE+-")) <= MAX_EXPONENT_DIGITS
    # The model did go on writing "1" until a bound stopped it (the part then moved on or closed).
    assert "1" * MAX_INTEGER_DIGITS in choice.message.content, choice.message.content
    assert isinstance(json.loads(choice.message.content)["population_millions"], float | int)


def test_a_structured_reply_cut_by_max_tokens_says_so(worker: WorkerProcess) -> None:
    api = client(worker)
    args = dict(model=BASE, messages=MESSAGES, max_tokens=3, temperature=0, response_format=JSON_SCHEMA_FORMAT)
    cut = api.chat.completions.create(**args).choices[0]  # type: ignore[call-overload]
    assert cut.finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(cut.message.content)
    details = cut.model_extra["incomplete_details"]
    assert details["reason"] == "max_tokens" and details["param"] == "response_format"
    assert "cut-off beginning of a match" in details["message"]
    chunks = [c for c in api.chat.completions.create(**args, stream=True) if c.choices]  # type: ignore[call-overload]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices[0].model_extra["incomplete_details"] == details
    completion = api.completions.create(model=BASE, prompt="Answer:", max_tokens=2, temperature=0,
                                        extra_body={"guided_json": SCHEMA}).choices[0]
    assert completion.finish_reason == "length"
    assert completion.model_extra["incomplete_details"]["param"] == "guided_json"
    streamed = [c.choices[0] for c in api.completions.create(model=BASE, prompt="Answer:", max_tokens=2, temperature=0,
                                                             stream=True, extra_body={"guided_json": SCHEMA})]
    assert streamed[-1].model_extra["incomplete_details"]["param"] == "guided_json"
    # Free text cut by max_tokens is not structured output: nothing to say.
    free = api.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=3, temperature=0).choices[0]
    assert free.finish_reason == "length" and "incomplete_details" not in free.model_extra


def test_free_output_beside_constrained_is_unchanged(worker: WorkerProcess) -> None:
    api = client(worker)
    free = dict(model="beta", prompt="Once upon a time", max_tokens=16, temperature=0)
    alone = api.completions.create(**free).choices[0].text  # type: ignore[call-overload]
    # Sent at once, so the engine batches them.
    with ThreadPoolExecutor(3) as pool:
        constrained = [pool.submit(api.completions.create, model=model, prompt="Once upon a time", max_tokens=60,
                                   temperature=0, extra_body={"guided_json": SCHEMA}) for model in ("beta", BASE)]
        beside = pool.submit(api.completions.create, **free)
        for future in constrained:
            jsonschema.validate(json.loads(future.result().choices[0].text), SCHEMA)
        assert beside.result().choices[0].text == alone


@pytest.mark.parametrize(("kwargs", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format", 'Unsupported type "frobnicate"'),
    ({"extra_body": {"guided_regex": "(?<=a)b"}}, "guided_regex", "Lookbehind is not supported"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}}, "response_format",
     "guided_regex and response_format each constrain the output"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice", "non-empty list"),
    ({"response_format": {"type": "json_schema"}}, None, "needs its json_schema"),
])
def test_refused_constraints_are_400s_naming_them(worker: WorkerProcess, kwargs: dict[str, object], param: str | None,
                                                  message: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(worker).chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=8, **kwargs)  # type: ignore[call-overload]
    error = caught.value.body
    assert isinstance(error, dict)
    assert message in error["message"]
    if param is not None:
        assert error["param"] == param


def _nested_schema(depth: int) -> dict[str, object]:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_grammar_whose_language_is_empty_is_a_400_not_a_500(worker: WorkerProcess) -> None:
    # Every rule needs itself first: no token is allowed at all, which the sampler would meet as a
    # row of -inf (a 500 before); the compile refuses it.
    with pytest.raises(openai.BadRequestError) as caught:
        client(worker).completions.create(model=BASE, prompt="Answer:", max_tokens=8,
                                          extra_body={"guided_grammar": "root ::= root root"})
    error = caught.value.body
    assert isinstance(error, dict)
    assert "matches no output" in error["message"] and error["param"] == "guided_grammar"
    assert client(worker).completions.create(model=BASE, prompt="Answer:", max_tokens=2).choices


def test_a_grammar_that_dead_ends_after_some_text_is_a_400_or_its_streams_error_event(worker: WorkerProcess) -> None:
    # After "a" the grammar allows nothing ("x" needs itself first): the caller's grammar, not an
    # engine failure (it was a 500 the gateway counted against the worker).
    grammar = {"guided_grammar": 'root ::= "a" x\nx ::= x "b"'}
    with pytest.raises(openai.BadRequestError) as caught:
        client(worker).completions.create(model=BASE, prompt="Answer:", max_tokens=8, extra_body=grammar)
    error = caught.value.body
    assert isinstance(error, dict)
    assert "allows no token and cannot end" in error["message"] and error["param"] == "guided_grammar"
    response = httpx.post(f"{worker.url}/v1/completions", timeout=120, json={
        "model": BASE, "prompt": "Answer:", "max_tokens": 8, "stream": True, **grammar})
    # The stream's head goes out with its first output: when the dead end comes in the same
    # delivery as the "a" before it (a loaded machine's steps outrun the HTTP side), nothing was sent
    # yet and the answer is the same 400; otherwise the stream ends with the error event.
    if response.status_code == 400:
        assert response.json()["error"]["param"] == "guided_grammar"
        return
    assert response.status_code == 200, response.text
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["param"] == "guided_grammar"


def _wide_schema(depth: int, width: int) -> dict[str, object]:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {f"p{i}": schema for i in range(width)}}
    return schema


@pytest.mark.e2e
def test_the_compile_budget_refuses_with_grammar_too_complex_naming_the_field(tiny_model: Path) -> None:
    """A worker with a small budget (nesting 10 JSON levels, 1 ms a compile): a schema nested past
    it is refused before compiling, one within it whose compile outlasts the time (a 44 KB schema
    of nested objects 6 wide: about 0.2 s of conversion) is killed and refused; both are 400s with
    the code and the field, and the worker serves on."""
    args = ServerArgs(model=str(tiny_model), device="cpu", max_loras=0, max_model_len=512, num_gpu_blocks_override=64,
                      slot_verify_interval=0, served_model_name=[BASE], grammar_compile_timeout=0.001,
                      max_grammar_schema_depth=10)
    deep = {"type": "json_schema", "json_schema": {"name": "deep", "schema": _nested_schema(5)}}
    with serve_in_process(args) as (_, url):
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            api.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=8,
                                        response_format=deep)  # type: ignore[arg-type]
        error = caught.value.body
        assert isinstance(error, dict)
        assert (error["code"], error["param"]) == ("grammar_too_complex", "response_format")
        assert "nests 11 levels deep" in error["message"]
        with pytest.raises(openai.BadRequestError) as caught:
            api.completions.create(model=BASE, prompt="Answer:", max_tokens=8,
                                   extra_body={"guided_json": _wide_schema(4, 6)})
        error = caught.value.body
        assert isinstance(error, dict)
        assert (error["code"], error["param"]) == ("grammar_too_complex", "guided_json")
        assert "took longer than this worker's budget of 0.001 s" in error["message"]
        assert api.completions.create(model=BASE, prompt="Answer:", max_tokens=2).choices
