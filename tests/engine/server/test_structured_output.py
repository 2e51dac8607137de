"""Structured output through the official `openai` client on a real worker: `response_format`
(json_schema, json_object) on chat and vLLM's guided_* fields on both endpoints, streamed and not;
a schema the grammar library refuses, two constraints at once or a malformed one are 400s naming
the field and the construct."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.engine.server.conftest import WorkerProcess

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
