"""OPTIONS on OpenAI's files and fine-tuning routes (docs/security.md): 200 with `Allow`, not a 500.

DRF answers OPTIONS with a description of the view, and for a view that takes POST it describes the
request serializer; these views take OpenAI's shapes without a DRF serializer, so that step raised
AssertionError ("should either include a `serializer_class` attribute").
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db

ROUTES = {
    "/v1/files": {"GET", "POST", "HEAD", "OPTIONS"},
    "/v1/files/file-1": {"GET", "DELETE", "HEAD", "OPTIONS"},
    "/v1/files/file-1/content": {"GET", "HEAD", "OPTIONS"},
    "/v1/fine_tuning/jobs": {"GET", "POST", "HEAD", "OPTIONS"},
    "/v1/fine_tuning/jobs/ftjob-1": {"GET", "HEAD", "OPTIONS"},
    "/v1/fine_tuning/jobs/ftjob-1/cancel": {"POST", "OPTIONS"},
    "/v1/fine_tuning/jobs/ftjob-1/events": {"GET", "HEAD", "OPTIONS"},
    "/v1/fine_tuning/jobs/ftjob-1/checkpoints": {"GET", "HEAD", "OPTIONS"},
}


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_options_answers_allow(client_a, path: str) -> None:
    response = client_a.options(path)
    assert response.status_code == 200, response.content
    assert {method.strip() for method in response["Allow"].split(",")} == ROUTES[path]
    assert response["Content-Type"] == "application/json"
    assert response.json()["name"]


def test_options_needs_a_key(api_client) -> None:
    """OPTIONS is not a way around authentication: it answers 401 like every other method."""
    response = api_client.options("/v1/fine_tuning/jobs")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
