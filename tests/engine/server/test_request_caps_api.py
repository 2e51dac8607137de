"""The request caps (serving.contracts.request_caps) at the serving worker: a body with NaN or Infinity,
nested past the bound (100,000 deep was a RecursionError), 95,000 stop strings or 19,000 tools is a
400 naming the field, decided while the body is decoded, before pydantic or the engine sees it (the
in-process app below never starts its engine: a request that got past decoding would be its 503
`loading`); a seed past the generator's range and a nested value pydantic refuses name their
field too. On the shared worker: a grammar that matches nothing is a 400, duplicate tool names are
found among many, and no completions or chat body a caller sends makes the worker answer 5xx."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.engine.server.app import build_app
from serving.engine.server.cli import ServerArgs
from serving.engine.server.worker import Worker
from serving.contracts import request_caps as caps
from tests.engine.server.conftest import WorkerProcess

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def unstarted(tiny_model) -> Iterator[TestClient]:
    """The worker's real app, its engine never started (no lifespan)."""
    yield TestClient(build_app(Worker(ServerArgs(model=str(tiny_model), device="cpu"))), raise_server_exceptions=False)


def post(client: TestClient, path: str, raw: str | bytes) -> httpx.Response:
    return client.post(path, content=raw, headers={"Content-Type": "application/json"})


def assert_refused(response: httpx.Response, param: str | None, code: str) -> dict:
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == code and error["type"] == "invalid_request_error", error
    return error


def tools(count: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(count)]


def test_nan_and_infinity_are_400s_naming_the_field(unstarted):
    for path, raw, param in [
        ("/v1/completions", '{"model": "m", "prompt": "p", "temperature": NaN}', "temperature"),
        ("/v1/completions", '{"model": "m", "prompt": "p", "top_p": 1e400}', "top_p"),
        ("/v1/chat/completions", '{"model": "m", "messages": [], "logit_bias": {"5": -Infinity}}', "logit_bias.5"),
    ]:
        assert_refused(post(unstarted, path, raw), param, caps.NON_FINITE_NUMBER)


def test_a_body_nested_past_the_bound_is_a_400_on_every_route(unstarted):
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter", "/v1/prefetch_lora_adapters"):
        error = assert_refused(post(unstarted, path, "[" * 100_000 + "]" * 100_000), None, caps.NESTING_TOO_DEEP)
        assert str(caps.MAX_JSON_DEPTH) in error["message"]
    schema: dict = {"type": "string"}
    for _ in range(40):  # 80 levels of JSON inside the request's 4
        schema = {"type": "object", "properties": {"a": schema}}
    refused = post(unstarted, "/v1/chat/completions", json.dumps({
        "model": "m", "messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
            "name": "deep", "schema": schema}}}))
    assert_refused(refused, None, caps.NESTING_TOO_DEEP)


def test_fields_over_their_caps_are_400s_before_the_request_is_read(unstarted):
    assert len(json.dumps(tools(19_000))) < 1024 * 1024  # within the worker's body bound: the cap refuses it
    for path, body, param in [
        ("/v1/completions", {"model": "m", "prompt": "p", "stop": [f"s{i}" for i in range(95_000)]}, "stop"),
        ("/v1/chat/completions", {"model": "m", "messages": CHAT, "tools": tools(19_000),
                                  "tool_choice": {"type": "function", "function": {"name": "none-of-them"}}}, "tools"),
        ("/v1/chat/completions", {"model": "m", "messages": CHAT, "functions": [{"name": f"f{i}"} for i in range(129)]},
         "functions"),
        ("/v1/completions", {"model": "m", "prompt": "p", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ("/v1/completions", {"model": "m", "prompt": "p", "guided_grammar": "root ::= " + '"a" ' * 10_000},
         "guided_grammar"),
        ("/v1/completions", {"model": "m" * 300, "prompt": "p"}, "model"),
    ]:
        error = post(unstarted, path, json.dumps(body)).json()["error"]
        assert error["param"] == param and "at most" in error["message"], error
    # Within the caps the body is the engine's business: here, not loaded yet.
    within = post(unstarted, "/v1/chat/completions", json.dumps({"model": "m", "messages": CHAT, "tools": tools(128),
                                                                 "stop": ["x"] * 16}))
    assert within.status_code == 503 and within.json()["error"]["code"] == "loading"


def test_a_seed_beyond_the_generators_range_is_a_400_naming_it(unstarted):
    """It was a 400 without a field, from the engine's "Overflow when unpacking long long"."""
    for seed in (2**64, -(2**63) - 1, 10**30):
        refused = post(unstarted, "/v1/completions", json.dumps({"model": "m", "prompt": "p", "seed": seed}))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "seed", refused.text


def test_a_grammar_that_matches_nothing_is_a_400(worker: WorkerProcess):
    for grammar in ("root ::= root root", 'root ::= root "a"', "root ::= undefined_rule"):
        reply = httpx.post(f"{worker.url}/v1/completions", timeout=120,
                           json={"model": "tiny-base", "prompt": "hi", "max_tokens": 4, "guided_grammar": grammar})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "guided_grammar"


def test_duplicate_tool_names_among_many_are_named(worker: WorkerProcess):
    offered = tools(caps.MAX_TOOLS)
    offered[100]["function"]["name"] = offered[7]["function"]["name"] = "twice"
    reply = httpx.post(f"{worker.url}/v1/chat/completions", timeout=120,
                       json={"model": "tiny-base", "messages": CHAT, "max_tokens": 1, "tools": offered})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools", reply.text
    assert "twice" in reply.json()["error"]["message"]


# Values of every type for the fields the worker reads, and a few extreme numbers.
_ANY = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=12)
_NUMBER = st.sampled_from([0, 1, -1, 2**31, 2**63, -(2**63) - 1, 10**30, 1e300, -1e-300, 0.5, 3]) | _ANY
_FIELDS = {
    "temperature": _NUMBER, "top_p": _NUMBER, "top_k": _NUMBER, "seed": _NUMBER, "n": st.sampled_from([1, 2]) | _ANY,
    "best_of": st.sampled_from([1, 2, 3]) | _ANY, "max_tokens": st.sampled_from([1, 2, 10**9]) | _ANY,
    "min_tokens": _NUMBER, "priority": _NUMBER, "presence_penalty": _NUMBER, "repetition_penalty": _NUMBER,
    "logit_bias": st.dictionaries(st.sampled_from(["0", "5", "-1", "99999999999999999999", " 7", "x"]), _NUMBER,
                                  max_size=3) | _ANY,
    "stop": st.lists(st.text(max_size=4), max_size=4) | _ANY, "stop_token_ids": st.lists(_NUMBER, max_size=3) | _ANY,
    "logprobs": _NUMBER, "echo": _ANY, "stream": st.booleans(), "ignore_eos": _ANY, "cache_salt": _ANY,
    "guided_choice": st.lists(st.text(max_size=4), max_size=3) | _ANY, "guided_regex": st.text(max_size=6) | _ANY,
    "guided_json": st.sampled_from(['{"type": "object"}', "[", '{"type": 5}', "{}"]) | _ANY,
    "prompt": st.text(max_size=6) | st.lists(st.integers(min_value=-3, max_value=2**40), max_size=3) | _ANY,
}


def some_of(fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy[dict]:
    """A few of `fields` (all of them at once would nearly always hold one the protocol refuses)."""
    return st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: fields[name] for name in names}))


@given(body=some_of(_FIELDS).map(lambda body: {"model": "tiny-base", "prompt": "hi", "max_tokens": 2, **body}))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
def test_no_completion_body_makes_the_worker_answer_5xx(worker: WorkerProcess, body: dict):
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{worker.url}/v1/completions", json=body) as reply:
            text = reply.read().decode()
    assert reply.status_code < 500, (body, text[:500])
    assert '"internal_error"' not in text, (body, text[:500])  # nor as a streamed error event


def test_a_nested_value_pydantic_refuses_names_the_requests_field(unstarted):
    """Not the last step of pydantic's path: a dict key ("5") or a union member's type ("str")."""
    for body, param in (({"model": "m", "prompt": "p", "logit_bias": {"5": "x"}}, "logit_bias"),
                        ({"model": "m", "prompt": "p", "stop": 5}, "stop"),
                        ({"model": "m", "messages": [{"role": "robot"}]}, "messages")):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        refused = post(unstarted, path, json.dumps(body))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text


_TEXT = st.text(alphabet="ab{}\"\\ .", max_size=5)
_SCHEMA = st.sampled_from([{"type": "object"}, {"type": 5}, {"$ref": "#/nope"}, {"type": "integer", "minimum": 3,
                                                                                 "maximum": 1},
                           {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]}]) | _ANY
_FUNCTION = st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "bad name", ""]) | _ANY},
                                  optional={"parameters": _SCHEMA, "description": _ANY})
_CALL = st.fixed_dictionaries({"id": st.sampled_from(["c1", "c2"]) | _ANY, "function": st.fixed_dictionaries(
    {"name": st.just("f") | _ANY, "arguments": st.sampled_from(["{}", "[]", "{oops", '{"a": 1}']) | _ANY})})
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "function"]) | _ANY},
    optional={"content": _TEXT | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"])},
                                                                optional={"text": _TEXT | _ANY}), max_size=2) | _ANY,
              "name": _TEXT | _ANY, "tool_calls": st.lists(_CALL, max_size=2) | _ANY,
              "tool_call_id": st.sampled_from(["c1", "c2"]) | _ANY})
_CHAT_FIELDS = {
    "messages": st.lists(_MESSAGE, min_size=1, max_size=3) | _ANY,
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function") | _ANY, "function": _FUNCTION}),
                      max_size=2) | _ANY,
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]) | _ANY,
    "functions": st.lists(_FUNCTION, max_size=2) | _ANY,
    "function_call": st.sampled_from(["none", "auto", {"name": "f"}]) | _ANY,
    "parallel_tool_calls": _ANY,
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"]) | _ANY},
        optional={"json_schema": st.fixed_dictionaries({"name": st.just("s") | _ANY, "schema": _SCHEMA})}) | _ANY,
    "logprobs": _ANY, "top_logprobs": _NUMBER, "add_generation_prompt": _ANY, "continue_final_message": _ANY,
    "chat_template_kwargs": _ANY, "max_completion_tokens": st.sampled_from([1, 2]) | _ANY, "stream": st.booleans(),
    "n": st.sampled_from([1, 2]) | _ANY, "stop": st.lists(_TEXT, max_size=3) | _ANY,
}


@given(body=some_of(_CHAT_FIELDS).map(lambda body: {"model": "tiny-base", "messages": CHAT, "max_tokens": 2, **body}))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
def test_no_chat_body_makes_the_worker_answer_5xx(worker: WorkerProcess, body: dict):
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{worker.url}/v1/chat/completions", json=body) as reply:
            text = reply.read().decode()
    assert reply.status_code < 500, (body, text[:500])
    assert '"internal_error"' not in text, (body, text[:500])
