"""Every error under /api/ and /v1/ is OpenAI-shaped JSON, never an HTML page; other paths keep HTML."""

from __future__ import annotations

import pytest
from django.urls import path
from rest_framework.test import APIClient

from lora_platform.urls import urlpatterns as platform_urlpatterns


def boom(request):
    raise RuntimeError("a bug")


# This module doubles as a URL conf: the platform's routes plus views that fail.
urlpatterns = [*platform_urlpatterns, path("api/v1/boom", boom), path("v1/boom", boom), path("boom", boom)]


def error_of(response) -> dict:
    assert response["Content-Type"] == "application/json", response.content[:200]
    return response.json()["error"]


@pytest.mark.django_db
@pytest.mark.parametrize("url", ["/api/v1/no-such-thing", "/v1/no-such-thing", "/api/nothing/"])
def test_unknown_api_paths_are_json_404(client_a, url: str) -> None:
    response = client_a.get(url)
    assert response.status_code == 404
    assert error_of(response) == {"message": f"No route for GET {url}.", "type": "invalid_request_error",
                                  "code": "not_found", "param": None}


@pytest.mark.django_db
def test_other_paths_keep_html_404(client) -> None:
    response = client.get("/no-such-page")
    assert response.status_code == 404 and response["Content-Type"].startswith("text/html")


@pytest.mark.django_db
def test_method_not_allowed_is_json_405(client_a) -> None:
    response = client_a.put("/api/v1/tenant", {}, format="json")
    assert response.status_code == 405
    assert "PUT" in error_of(response)["message"]


@pytest.mark.django_db
def test_unsupported_media_type_is_json_415(client_a) -> None:
    response = client_a.post("/api/v1/api-keys", data="name=x", content_type="text/plain")
    assert response.status_code == 415
    assert "text/plain" in error_of(response)["message"]


@pytest.mark.django_db
def test_malformed_json_is_a_json_400(client_a) -> None:
    response = client_a.post("/api/v1/api-keys", data="{not json", content_type="application/json")
    assert response.status_code == 400 and "JSON" in error_of(response)["message"]


@pytest.mark.django_db
def test_oversized_bodies_are_json_413_naming_the_limit(client_a, settings) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    settings.MAX_UPLOAD_BYTES = 5000
    response = client_a.post("/api/v1/api-keys", {"name": "x" * 2000}, format="json")
    assert response.status_code == 413
    error = error_of(response)
    assert error["code"] == "payload_too_large" and "limit is 1000 bytes" in error["message"]

    upload = client_a.post("/api/v1/api-keys", {"name": "k", "file": ("x" * 6000)}, format="multipart")
    assert upload.status_code == 413 and "limit is 5000 bytes" in error_of(upload)["message"]
    assert client_a.get("/api/v1/api-keys").json()["data"][0]["name"] == "default"


@pytest.mark.django_db
@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.urls(__name__)
def test_uncaught_exceptions_are_json_500_under_the_api_whatever_debug_is(settings, debug: bool) -> None:
    settings.DEBUG = debug
    client = APIClient(raise_request_exception=False)
    for url in ("/api/v1/boom", "/v1/boom"):
        response = client.get(url)
        assert response.status_code == 500
        error = error_of(response)
        assert error["code"] == "internal_error" and "a bug" not in error["message"]
    assert client.get("/boom")["Content-Type"].startswith("text/html")
