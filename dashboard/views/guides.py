"""The guides: the project's docs/*.md, rendered in the dashboard (`/guides/<name>/`), so the pages
can link to the guide of what they show and the links work offline, where the dashboard runs.

Markdown is rendered by markdown-it-py with raw HTML off (a guide's text is the project's, but
nothing in it should run); links to another guide (`registry.md#canary`) become its dashboard page,
headings get GitHub's anchors so those links land, and the screenshots are served beside them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from django.conf import settings
from django.http import FileResponse, Http404, HttpResponse
from django.shortcuts import render
from django.urls import reverse
from django.utils.html import escape
from markdown_it import MarkdownIt
from markdown_it.token import Token

from dashboard.tenancy import DashboardRequest, Role, dashboard_view

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
_GUIDE_LINK = re.compile(r"^(?:docs/)?([a-z0-9][a-z0-9_-]*)\.md(#[^\s]*)?$")
_markdown = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable("table")


def _docs_dir() -> Path:
    return Path(settings.BASE_DIR) / "docs"


def guide_names() -> list[str]:
    """Every guide: the Markdown files directly in docs/."""
    return sorted(path.stem for path in _docs_dir().glob("*.md"))


def _anchor(text: str) -> str:
    """GitHub's heading anchor: lowercase, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _rewrite(tokens: list[Token]) -> None:
    """Anchors on headings; links to guides and screenshots pointed at the dashboard's routes."""
    for index, token in enumerate(tokens):
        if token.type == "heading_open" and index + 1 < len(tokens):
            token.attrSet("id", _anchor(tokens[index + 1].content))
        for child in token.children or []:
            if child.type == "link_open":
                href = str(child.attrGet("href") or "")
                found = _GUIDE_LINK.match(href)
                if found:
                    child.attrSet("href", reverse("dashboard:guide", args=[found.group(1)]) + (found.group(2) or ""))
            elif child.type == "image":
                source = str(child.attrGet("src") or "")
                name = source.removeprefix("docs/").removeprefix("screenshots/")
                if source != name and _NAME.match(Path(name).stem) and name.endswith(".png"):
                    child.attrSet("src", reverse("dashboard:guide-screenshot", args=[name]))


def _html(text: str) -> str:
    tokens = _markdown.parse(text)
    _rewrite(tokens)
    rendered: str = _markdown.renderer.render(tokens, _markdown.options, {})
    return rendered


def _title(text: str, name: str) -> str:
    first = next((line for line in text.splitlines() if line.startswith("# ")), "")
    return first[2:].strip() or name


def _guide(request: DashboardRequest, name: str) -> HttpResponse:
    names = guide_names()
    if not _NAME.match(name) or name not in names:
        raise Http404(f"No guide '{escape(name)}'.")
    text = (_docs_dir() / f"{name}.md").read_text()
    context: dict[str, Any] = {"guide": name, "title": _title(text, name), "body": _html(text), "guides": names,
                               "nav": "guides"}
    return render(request, "dashboard/guide.html", context)


@dashboard_view(Role.VIEWER)
def guide_view(request: DashboardRequest, name: str) -> HttpResponse:
    return _guide(request, name)


@dashboard_view(Role.VIEWER)
def guide_index_view(request: DashboardRequest) -> HttpResponse:
    """The dashboard's own guide first: it says what each page does and links to the others."""
    return _guide(request, "dashboard")


@dashboard_view(Role.VIEWER)
def guide_screenshot_view(request: DashboardRequest, name: str) -> FileResponse:
    path = _docs_dir() / "screenshots" / name
    if not name.endswith(".png") or not _NAME.match(name.removesuffix(".png")) or not path.is_file():
        raise Http404("No such screenshot.")
    return FileResponse(path.open("rb"), content_type="image/png")
