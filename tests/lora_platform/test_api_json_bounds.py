"""Issue 37, item 8: a JSON body nested 100,000 deep (or holding NaN) on the DRF routes is a 400 in
OpenAI's shape, not the 500 of the decoder's RecursionError; the bound is the gateway's
(serving.contracts.request_caps.MAX_JSON_DEPTH), measured without recursion."""

from __future__ import annotations

import pytest

from serving.contracts.request_caps import MAX_JSON_DEPTH

DEEP = "[" * 100_000 + "]" * 100_000

# Each JSON route, through each way its view takes JSON: the default parsers (api-keys), and views
# that name their own (training jobs, the OpenAI jobs and uploads, adapters).
ROUTES = ["/api/v1/api-keys", "/api/v1/training-jobs", "/v1/fine_tuning/jobs", "/v1/uploads", "/api/v1/adapters"]


@pytest.mark.django_db
@pytest.mark.parametrize("path", ROUTES)
def test_a_100000_deep_body_is_a_400_naming_the_bound(client_a, path):
    response = client_a.post(path, DEEP, content_type="application/json")
    assert response.status_code == 400, response.content[:300]
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "nesting_too_deep"
    assert str(MAX_JSON_DEPTH) in error["message"]


@pytest.mark.django_db
@pytest.mark.parametrize("path", ROUTES)
def test_nesting_within_the_bound_is_left_to_the_view(client_a, path):
    body = "{\"a\": " * (MAX_JSON_DEPTH - 1) + "1" + "}" * (MAX_JSON_DEPTH - 1)
    response = client_a.post(path, body, content_type="application/json")
    assert response.status_code < 500 and response.json()["error"]["code"] != "nesting_too_deep"


@pytest.mark.django_db
def test_nan_and_text_that_is_not_json_are_400s(client_a):
    response = client_a.post("/api/v1/api-keys", '{"name": NaN}', content_type="application/json")
    assert response.status_code == 400 and response.json()["error"]["code"] == "non_finite_number"
    assert response.json()["error"]["param"] == "name"
    response = client_a.post("/api/v1/api-keys", '{"name": ', content_type="application/json")
    assert response.status_code == 400 and "JSON parse error" in response.json()["error"]["message"]
