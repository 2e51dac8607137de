"""/favicon.ico answers with an icon (browsers ask for it on every page; it was a 404: issue 39, item 8)."""

from __future__ import annotations

import struct

import pytest


@pytest.mark.django_db
def test_the_favicon_is_a_16_pixel_icon_cached_for_a_day(client) -> None:
    response = client.get("/favicon.ico")
    assert response.status_code == 200 and response["Content-Type"] == "image/x-icon"
    assert response["Cache-Control"] == "public, max-age=86400"
    reserved, kind, count = struct.unpack("<HHH", response.content[:6])
    width, height = response.content[6], response.content[7]
    assert (reserved, kind, count, width, height) == (0, 1, 1, 16, 16)
    assert client.post("/favicon.ico").status_code == 405
