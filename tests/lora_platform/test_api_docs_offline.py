"""The API docs pages (Swagger UI at /api/docs/, Redoc at /api/redoc/) work without internet: the page
names no other host, and every script, style sheet and icon it loads is served by the web process
itself (drf-spectacular-sidecar's static files), as is the schema it renders."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest

# An absolute or scheme-relative URL: anything the browser would fetch from another host.
EXTERNAL = re.compile(r"(?:\b[a-z][a-z0-9+.-]*:)?//[a-z0-9-]+(?:\.[a-z0-9-]+)+", re.IGNORECASE)
# What a style sheet loads: url(...) other than an inline data: URI.
CSS_URL = re.compile(r"url\(\s*['\"]?(?!data:)([^'\")]+)", re.IGNORECASE)


class Resources(HTMLParser):
    """The URLs a page makes the browser load: scripts, style sheets, icons, Redoc's spec-url."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        for name in ("src", "href", "spec-url"):
            if values.get(name):
                self.urls.append(values[name] or "")


@pytest.mark.parametrize("path", ["/api/docs/", "/api/redoc/"])
def test_the_docs_page_names_no_other_host_and_everything_it_loads_is_served_here(client, path: str) -> None:
    page = client.get(path)
    assert page.status_code == 200
    html = page.content.decode()
    assert EXTERNAL.findall(html) == [], "the page would reach the internet"

    parser = Resources()
    parser.feed(html)
    assert len(parser.urls) >= 2  # at least the bundle and the schema (or the style sheet)
    for url in parser.urls:
        assert url.startswith("/") and not url.startswith("//"), url
        response = client.get(url)
        assert response.status_code == 200, url
        if url.endswith(".css"):
            body = b"".join(response.streaming_content).decode()
            assert [found for found in CSS_URL.findall(body) if EXTERNAL.match(found)] == [], url


def test_the_swagger_page_loads_the_packaged_swagger_ui_on_our_schema(client) -> None:
    html = client.get("/api/docs/").content.decode()
    assert '<script src="/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js">' in html
    assert 'url: "/api/schema/"' in html
    # No validator badge: Swagger UI would send the schema to validator.swagger.io for it.
    assert '"validatorUrl": null' in html
