"""What the gateway takes from a caller's body and what it forwards: the body decoded and checked
once (lone surrogates, internal `loraplex_*` fields, the model name's length), the worker's
request built from an allow-list, and which outcomes count toward a worker's ejection; the request
caps (serving.contracts.request_caps): non-finite numbers, nesting, oversized fields, and no body that
makes decoding fail other than with a 400."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.gateway.records import Call, Caller, Target, TierLimits
from serving.gateway.errors import GatewayError
from serving.gateway.proxy import UpstreamResult
from serving.gateway.request_fields import (
    FORWARDED,
    MODEL_MAX_CHARS,
    decode_body,
    estimate_prompt_tokens,
    requested_max_tokens,
    requested_sequences,
)
from serving.gateway.resilience import worker_failed
from serving.gateway.routing import WorkerView
from serving.gateway.upstream import upstream_body
from serving.gateway.version_pick import ServedVersion
from serving.contracts.request_caps import MAX_JSON_DEPTH

CALLER = Caller(tenant_id=1, tenant="alice-co", key_prefix="abc",
                tier=TierLimits(name="standard", requests_per_minute=200, tokens_per_minute=100_000,
                                max_tokens_per_request=256, priority=1, degradation_allowed=True))
WORKER = WorkerView(worker_id="w1", url="http://w1", base_model="tiny", served_model_names=("tiny",), max_loras=2,
                    max_model_len=2048, queue_depth=0, kv_cache_usage=0.0)
VERSION = ServedVersion(tenant="alice-co", adapter="bot", version="1.0.0", artifact_uri="file:///a",
                        manifest_sha256="0" * 64, status="active")


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def refusal(raw: bytes) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        decode_body(raw)
    assert caught.value.status == 400
    return caught.value


def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field():
    for raw, param in [
        (rb'{"model": "\ud800"}', "model"),
        (rb'{"model": "bot", "user": "x\uDC00y"}', "user"),
        (rb'{"model": "bot", "messages": [{"role": "user", "content": "hi \ud800"}]}', "messages[0].content"),
        (rb'{"model": "bot", "prompt": "p", "stop": ["ok", "\udbff"]}', "stop[1]"),
        (rb'{"model": "bot", "metadata": {"\ud800": 1}}', "metadata.<key>"),
    ]:
        error = refusal(raw)
        assert error.code == "invalid_unicode" and error.param == param, (raw, error.param)
        assert "surrogate" in error.message
        json.loads(error.body())  # the refusal itself encodes
    # The same surrogate sent as raw (invalid) UTF-8 bytes is not UTF-8.
    assert "UTF-8" in refusal(b'{"model": "\xed\xa0\x80"}').message


def test_surrogate_pairs_and_other_escapes_are_text():
    body = decode_body(rb'{"model": "bot", "messages": [{"role": "user", "content": "\ud83d\ude00 \u00e9"}]}')
    assert body["messages"][0]["content"] == "\U0001f600 \u00e9"


def test_internal_fields_from_the_caller_are_refused_by_name():
    for name in ("loraplex_adapter", "loraplex_anything"):
        error = refusal(json.dumps({"model": "tiny", "prompt": "p", name: {"artifact_uri": "file:///etc"}}).encode())
        assert error.code == "internal_field" and error.param == name and name in error.message


def test_a_model_name_over_the_bound_is_refused_before_any_lookup():
    assert decode_body(json.dumps({"model": "m" * MODEL_MAX_CHARS}).encode())["model"] == "m" * MODEL_MAX_CHARS
    error = refusal(json.dumps({"model": "m" * (MODEL_MAX_CHARS + 1)}).encode())
    assert error.code == "model_name_too_long" and error.param == "model"
    assert str(MODEL_MAX_CHARS) in error.message and str(MODEL_MAX_CHARS + 1) in error.message


def call(endpoint: str, body: dict, *, version: ServedVersion | None = None) -> Call:
    return Call(endpoint=endpoint, caller=CALLER, body=body, model=body["model"],
                target=Target(base=version is None, pinned=version), max_tokens=16, version=version)


def test_the_workers_request_holds_only_allowed_fields():
    body = {"model": "bot", "prompt": "p", "temperature": 0.5, "stop": ["x"], "user": "u-1", "metadata": {"a": 1},
            "store": True, "allow_degradation": False, "priority": -100, "max_completion_tokens": 3,
            "stream": True, "stream_options": {"include_usage": False}, "service_tier": "flex"}
    sent = upstream_body(call("completions", body, version=VERSION), WORKER)
    gateway_written = {"model", "max_tokens", "priority", "loraplex_adapter", "cache_salt"}
    assert set(sent) <= FORWARDED["completions"] | gateway_written
    assert sent["model"] == "alice-co/bot@1.0.0" and sent["priority"] == 1 and sent["max_tokens"] == 16
    assert sent["loraplex_adapter"] == {"artifact_uri": "file:///a", "manifest_sha256": "0" * 64}
    assert sent["temperature"] == 0.5 and sent["stop"] == ["x"] and sent["stream_options"] == {"include_usage": True}
    for dropped in ("user", "metadata", "store", "allow_degradation", "max_completion_tokens", "service_tier"):
        assert dropped not in sent
    chat = upstream_body(call("chat", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_k": 3,
                                       "user": "u", "prompt": "not chat's"}), WORKER)
    assert set(chat) == {"model", "messages", "top_k", "max_tokens", "priority", "cache_salt"}
    assert chat["model"] == "tiny"  # the base model: no loraplex_adapter at all


def test_the_prefix_cache_salt_is_the_tenants_own_whatever_the_caller_sends():
    """Cached prompt blocks are shared only within a salt: the gateway writes one per tenant, so
    one tenant's base-model prompts never hit (nor time) another's, and a caller cannot pick one."""
    body = {"model": "tiny", "prompt": "p", "cache_salt": f"tenant-{CALLER.tenant_id + 1}"}
    mine = upstream_body(call("completions", body), WORKER)
    other = upstream_body(replace(call("completions", body), caller=replace(CALLER, tenant_id=CALLER.tenant_id + 1)),
                          WORKER)
    assert mine["cache_salt"] == f"tenant-{CALLER.tenant_id}" != other["cache_salt"]


def result(status: int, code: str = "", *, ok: bool = False) -> UpstreamResult:
    outcome = UpstreamResult(worker_id="w1")
    if ok:
        outcome.status = "ok"
    else:
        outcome.refused(status, json.dumps({"error": {"code": code}}).encode())
    return outcome


def test_only_the_workers_own_failures_count_toward_its_ejection():
    assert worker_failed(result(200, ok=True)) is False
    assert worker_failed(result(500, "internal_error")) is True
    assert worker_failed(result(503, "loading")) is True
    assert worker_failed(result(401, "invalid_api_key")) is True  # the worker's key is misconfigured
    assert worker_failed(UpstreamResult(worker_id="w1")) is True  # no answer at all
    # The caller's fault, or the adapter's: neither a failure nor a success of the worker.
    assert worker_failed(result(400, "invalid_request")) is None
    assert worker_failed(result(404, "model_not_found")) is None
    assert worker_failed(result(500, "adapter_load_failed")) is None
    assert worker_failed(result(500, "adapter_digest_mismatch")) is None
    aborted = UpstreamResult(worker_id="w1")
    aborted.status = "aborted"
    assert worker_failed(aborted) is None


def test_non_finite_numbers_are_refused_naming_the_field():
    """The gateway's own json.dumps(allow_nan=False) of the worker's request raised on them: a 500."""
    for raw, param in [(b'{"model": "bot", "prompt": "p", "temperature": NaN}', "temperature"),
                       (b'{"model": "bot", "prompt": "p", "logit_bias": {"3": -Infinity}}', "logit_bias.3"),
                       (b'{"model": "bot", "prompt": "p", "top_p": 1e999}', "top_p")]:
        error = refusal(raw)
        assert error.code == "non_finite_number" and error.param == param, (raw, error.param)
        json.loads(error.body())


def test_a_body_nested_past_the_bound_is_a_400_not_a_recursion_error():
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"model": "bot", "x": ' + b"[" * 100_000 + b"}",
                json.dumps({"model": "bot", "prompt": "p", "x": nested(MAX_JSON_DEPTH)}).encode()):
        error = refusal(raw)
        assert error.code == "nesting_too_deep" and str(MAX_JSON_DEPTH) in error.message
    assert decode_body(json.dumps({"model": "bot", "x": nested(MAX_JSON_DEPTH - 1)}).encode())["model"] == "bot"


def test_fields_over_their_caps_are_refused_before_any_lookup():
    for extra, param in (({"stop": [f"s{i}" for i in range(95_000)]}, "stop"),
                         ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(19_000)]},
                          "tools"),
                         ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias")):
        error = refusal(json.dumps({"model": "bot", "prompt": "p", **extra}).encode())
        assert error.status == 400 and error.param == param and "at most" in error.message


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                     max_leaves=30)
_FIELDS = st.sampled_from(["model", "prompt", "messages", "stop", "tools", "functions", "logit_bias", "guided_json",
                           "guided_choice", "guided_regex", "guided_grammar", "response_format", "temperature", "n",
                           "best_of", "max_tokens", "stop_token_ids", "loraplex_adapter", "user"])


_PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | _JSON}, optional={"text": _JSON})
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool"]) | _JSON},
                                 optional={"content": _JSON | st.lists(_PART | _JSON, max_size=3), "name": _JSON})
_SHAPED = st.fixed_dictionaries({"model": st.text(min_size=1, max_size=8)}, optional={"messages": st.lists(_MESSAGE | _JSON, max_size=3) | _JSON,
    "prompt": st.lists(st.integers() | st.text(max_size=5) | st.lists(st.integers(), max_size=3), max_size=3) | _JSON,
    "n": st.integers() | _JSON, "best_of": st.integers() | _JSON, "max_tokens": st.integers() | _JSON,
    "max_completion_tokens": st.integers() | _JSON, "stream": st.booleans() | _JSON, "stream_options": _JSON})


@pytest.mark.slow
@given(st.one_of(
    st.binary(max_size=64),
    st.dictionaries(_FIELDS, _JSON, max_size=6).map(lambda body: json.dumps(body).encode()),
    _SHAPED.map(lambda body: json.dumps(body).encode()),
    st.tuples(st.dictionaries(_FIELDS, _JSON, max_size=4), st.sampled_from(["NaN", "-Infinity", "1e400", "[" * 70]))
    .map(lambda pair: json.dumps(pair[0])[:-1].encode() + b', "extra": ' + pair[1].encode() + b"}"),
))
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_no_body_makes_the_gateways_decoding_fail_other_than_with_a_400(raw: bytes):
    try:
        body = decode_body(raw)
    except GatewayError as error:
        assert error.status == 400
        json.loads(error.body())
        return
    for endpoint in ("completions", "chat"):
        steps = (requested_max_tokens, requested_sequences, estimate_prompt_tokens,
                 # What the worker is sent, as the gateway writes it.
                 lambda body, endpoint: json.dumps(upstream_body(call(endpoint, body), WORKER), allow_nan=False))
        for step in steps:
            try:
                step(body, endpoint)
            except GatewayError as error:
                assert error.status == 400


def test_stream_and_its_options_must_have_their_types():
    """The gateway reads both itself: `"stream_options": [1]` made building the worker's request raise (a 500)."""
    for extra, param in (({"stream": True, "stream_options": [1]}, "stream_options"),
                         ({"stream": True, "stream_options": "usage"}, "stream_options"),
                         ({"stream": "no"}, "stream")):
        assert refusal(json.dumps({"model": "bot", "prompt": "p", **extra}).encode()).param == param
    body = decode_body(json.dumps({"model": "bot", "prompt": "p", "stream": True, "stream_options": None}).encode())
    assert upstream_body(call("completions", body), WORKER)["stream_options"] == {"include_usage": True}
