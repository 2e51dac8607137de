"""Who may use a worker and what it reveals (docs/serving-worker.md, "What an operator must set"),
as the attack run tried it against real worker processes: without the operator's key nothing under
/v1/ answers; the `Bearer` scheme is read in any case; registry names
(`<tenant>/<adapter>@<version>`) cannot be loaded over or unloaded by anyone but the operator;
`/v1/models` shows storage paths to the operator only; adapters load from the allowed roots only,
and every other location, local or S3, gets one refusal that tells nothing about it; a hostile
adapter_config.json is a 400 naming it."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from serving.engine.server.errors import install_error_handlers

KEY = "operator-key-for-tests"
OPERATOR = {"Authorization": f"Bearer {KEY}"}
HIJACK = {"lora_name": "demo/bot@1.0.0", "load_inplace": True}


@pytest.fixture
def outside_adapter(make_adapter) -> Iterator[Path]:
    """A valid adapter in a directory outside every root the test workers allow."""
    where = Path(tempfile.mkdtemp(prefix="loraplex-outside-"))
    try:
        yield Path(shutil.copytree(make_adapter(seed=41), where / "adapter"))
    finally:
        shutil.rmtree(where)


def test_the_operator_key_guards_v1_and_bearer_is_read_in_any_case(start_worker, make_adapter, tiny_model, tmp_path):
    worker = start_worker("--api-key", KEY, "--served-model-name", "base", "--allowed-adapter-path", str(tmp_path))
    own = shutil.copytree(make_adapter(seed=42), tmp_path / "own")
    calls = [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"model": "base", "prompt": "hi", "max_tokens": 1}),
        ("POST", "/v1/chat/completions", {"model": "base", "messages": [{"role": "user", "content": "hi"}]}),
        ("POST", "/v1/load_lora_adapter", dict(HIJACK, lora_path=str(own))),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "demo/bot@1.0.0"}),
    ]
    with httpx.Client(base_url=worker.url, timeout=30) as http:
        for method, path, body in calls:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                            {"Authorization": KEY}, {"X-Api-Key": KEY}):
                response = http.request(method, path, json=body, headers=headers)
                assert response.status_code == 401, (path, headers, response.text)
                assert response.json()["error"]["code"] == "invalid_api_key"
        assert "demo/bot@1.0.0" not in worker.log()  # no refused call got as far as the adapters
        for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
            assert http.get("/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200, scheme
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200

        # The operator (the gateway) may load a registry name, and sees where models come from.
        loaded = http.post("/v1/load_lora_adapter", headers=OPERATOR, json=dict(HIJACK, lora_path=str(own)))
        assert loaded.status_code == 200, loaded.text
        roots = {card["id"]: card["root"] for card in http.get("/v1/models", headers=OPERATOR).json()["data"]}
        assert roots == {"base": str(tiny_model), "demo/bot@1.0.0": str(own)}
        reply = http.post("/v1/completions", headers=OPERATOR,
                          json={"model": "demo/bot@1.0.0", "prompt": "hi", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        assert http.post("/v1/unload_lora_adapter", headers=OPERATOR,
                         json={"lora_name": "demo/bot@1.0.0"}).status_code == 200


def test_an_open_worker_keeps_registry_names_and_storage_paths_to_itself(worker, make_adapter, tmp_path):
    own = shutil.copytree(make_adapter(seed=43), tmp_path / "own")
    with httpx.Client(base_url=worker.url, timeout=30) as http:
        for name in ("demo/bot@1.0.0", "alice-co/support-bot@1.2.0", "demo/bot@1.0.0 ", "/@"):
            for inplace in (False, True):
                refused = http.post("/v1/load_lora_adapter",
                                    json={"lora_name": name, "lora_path": str(own), "load_inplace": inplace})
                assert refused.status_code == 409, (name, refused.text)
                error = refused.json()["error"]
                assert error["code"] == "registry_name" and error["param"] == "lora_name"
                assert error["type"] == "conflict_error"
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 409
        cards = http.get("/v1/models").json()["data"]
        # Nobody is the operator of an open worker: roots are the models' ids, never a path.
        assert {card["id"] for card in cards} >= {"tiny-base", "alpha", "beta"}
        assert all(card["root"] == card["id"] for card in cards), cards
        assert str(tmp_path.parent.parent) not in json.dumps(cards)
        # Names of any other form stay the caller's to load.
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "own-adapter", "lora_path": str(own)}).status_code == 200
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "own-adapter"}).status_code == 200


def _refusal(response: httpx.Response, location: str) -> str:
    assert response.status_code == 400, (location, response.text)
    error = response.json()["error"]
    assert error["code"] == "lora_path_not_allowed" and error["param"] == "lora_path", error
    return error["message"].replace(repr(location), "<location>")


def test_adapters_load_only_from_allowed_roots_and_refusals_reveal_nothing(worker, outside_adapter, make_adapter,
                                                                           tmp_path):
    (tmp_path / "link").symlink_to(outside_adapter)
    locations = [
        str(outside_adapter),  # a valid adapter: refused for where it is, not for what it is
        f"file://{outside_adapter}",
        str(tmp_path / "link"),  # a link inside a root leading out of it
        f"{tmp_path}/../../../../../etc",
        "/etc",  # a directory without adapter_config.json
        "/etc/passwd",  # a file
        "/no/such/directory",
        "relative/adapter",
        "s3://some-bucket-the-worker-can-reach/adapters/x/",
        "http://169.254.169.254/latest/meta-data/",
    ]
    messages = set()
    with httpx.Client(base_url=worker.url, timeout=30) as http:
        for location in locations:
            response = http.post("/v1/load_lora_adapter", json={"lora_name": "outsider", "lora_path": location})
            messages.add(_refusal(response, location))
        assert "outsider" not in {card["id"] for card in http.get("/v1/models").json()["data"]}
        inside = shutil.copytree(make_adapter(seed=41), tmp_path / "inside")
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "insider", "lora_path": str(inside)}).status_code == 200
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "insider"}).status_code == 200
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "allowed adapter location" in message
    for telltale in ("exist", "missing", "directory", "not a", "permission", "adapter_config"):
        assert telltale not in message.replace("allowed adapter location", ""), (telltale, message)


def test_s3_adapters_load_from_the_platforms_storage_only(start_worker, make_adapter, s3_bucket, moto_s3_endpoint):
    """STORAGE_URL names the platform's storage; the worker takes it as its root without a flag."""
    client = boto3.client("s3", endpoint_url=moto_s3_endpoint)
    client.create_bucket(Bucket="another-bucket")
    adapter = make_adapter(seed=44)
    uris = {
        "inside": f"s3://{s3_bucket}/platform/adapters/alice-co/bot/1.0.0/",
        "sibling": f"s3://{s3_bucket}/platform-old/adapters/alice-co/bot/1.0.0/",
        "other": "s3://another-bucket/platform/adapters/alice-co/bot/1.0.0/",
    }
    for uri in uris.values():
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        for path in adapter.iterdir():
            client.upload_file(str(path), bucket, prefix + path.name)
    worker = start_worker("--served-model-name", "base", env={"STORAGE_URL": f"s3://{s3_bucket}/platform"})
    with httpx.Client(base_url=worker.url, timeout=60) as http:
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "from-storage", "lora_path": uris["inside"]})
        assert loaded.status_code == 200, loaded.text
        outside = [uris["sibling"], uris["other"], f"s3://{s3_bucket}/elsewhere/nothing/"]
        messages = {
            _refusal(http.post("/v1/load_lora_adapter", json={"lora_name": "outsider", "lora_path": uri}), uri)
            for uri in outside
        }
    assert len(messages) == 1, messages


def test_hostile_adapter_json_is_a_400_naming_the_file(worker, make_adapter, tmp_path):
    good = make_adapter(seed=45)
    cases = {
        "nested-config": ("adapter_config.json", '{"r": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested deeper"),
        "huge-config": ("adapter_config.json", json.dumps({"r": 8, "pad": "x" * (2 << 20)}), "larger than"),
        "nested-manifest": ("manifest.json", "[" * 100_000 + "]" * 100_000, "nested deeper"),
    }
    with httpx.Client(base_url=worker.url, timeout=60) as http:
        for case, (file_name, text, reason) in cases.items():
            directory = shutil.copytree(good, tmp_path / case)
            (directory / file_name).write_text(text)
            response = http.post("/v1/load_lora_adapter", json={"lora_name": case, "lora_path": str(directory)})
            assert response.status_code == 400, (case, response.text)
            message = response.json()["error"]["message"]
            assert file_name in message and reason in message, (case, message)
        assert http.get("/health").status_code == 200


def test_every_error_leaves_in_the_openai_shape(worker):
    with httpx.Client(base_url=worker.url, timeout=30) as http:
        for response in (http.get("/v1/nothing-here"), http.delete("/v1/models"), http.get("/v1/completions")):
            assert response.headers["content-type"] == "application/json", response.text
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    # An exception nobody anticipated: the same shape, its type named, no traceback to the caller.
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RecursionError("maximum recursion depth exceeded in the secret internals")

    response = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "internal_error" and "RecursionError" in error["message"]
    assert "secret internals" not in error["message"]
