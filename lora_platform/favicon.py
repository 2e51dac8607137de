"""/favicon.ico: browsers ask for it on every page, and a 404 for it filled the log (issue 39, item 8).

The icon (16x16, 1 KB) is read once and served with a day's caching; it is no static file because
browsers ask at the site's root, not under STATIC_URL, whether or not the web process serves static.
"""

from __future__ import annotations

import functools
from pathlib import Path

from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_safe

ICON = Path(__file__).with_suffix(".ico")


@functools.cache
def _icon() -> bytes:
    return ICON.read_bytes()


@require_safe
def favicon(request: HttpRequest) -> HttpResponse:
    response = HttpResponse(_icon(), content_type="image/x-icon")
    response["Cache-Control"] = "public, max-age=86400"
    return response
