"""One OpenAI error body and one status → type table (serving.contracts.errors) on every surface."""

from __future__ import annotations

import json

import pytest

from api.errors import error_response
from serving.engine.server.errors import error_body as worker_error_body
from serving.gateway.errors import GatewayError
from serving.contracts.errors import TYPE_BY_STATUS, Conflict, LimitExceeded, NotFound, error_type


@pytest.mark.parametrize("status", [*TYPE_BY_STATUS, 500, 502, 503])
def test_the_gateway_the_api_and_the_worker_answer_one_type_per_status(status: int) -> None:
    gateway = json.loads(GatewayError(status, "m", code="c").body())["error"]
    api = json.loads(error_response(status, "m", code="c").content)["error"]
    worker = worker_error_body(status, "m", code="c")["error"]

    assert gateway == api == worker == {"message": "m", "type": error_type(status), "param": None, "code": "c"}


def test_a_404_is_an_invalid_request_as_openai_answers_an_unknown_model() -> None:
    assert error_type(404) == "invalid_request_error"
    assert NotFound("gone").error_type == "invalid_request_error"
    assert (Conflict("taken").error_type, LimitExceeded("full").error_type) == ("conflict_error", "permission_error")
    assert error_type(503) == "api_error"
