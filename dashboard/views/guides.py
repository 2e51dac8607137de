"""The guides: the tenant guide (docs/tenants/*.md, the docs site's "Tenant guide"), rendered in the
dashboard at `/guides/<name>/`, so the pages link to the guide of what they show and the links work
offline, where the dashboard runs. The developers' notes (docs/*.md) are not served to tenants.

The pages and their order are the "Tenant guide" section of mkdocs.yml's nav: one list for the site
and the dashboard. Markdown is rendered by markdown-it-py with raw HTML off (a guide's text is the
project's, but nothing in it should run); links to another guide (`deploy.md#sticky-users`) become
its dashboard page, and headings get the anchors MkDocs gives them, so those links land.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from django.conf import settings
from django.http import Http404, HttpResponse
from django.shortcuts import render
from django.urls import reverse
from django.utils.html import escape
from markdown_it import MarkdownIt
from markdown_it.token import Token

from dashboard.tenancy import DashboardRequest, Role, dashboard_view

GUIDE_SECTION = "Tenant guide"
GUIDE_FOLDER = "tenants"
INDEX = "index"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
_GUIDE_LINK = re.compile(r"^([a-z0-9][a-z0-9_-]*)\.md(#[^\s]*)?$")
_markdown = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable("table")


@dataclass(frozen=True)
class GuidePage:
    name: str
    title: str


def _root() -> Path:
    return Path(settings.BASE_DIR)


@lru_cache(maxsize=1)
def _pages_of(config_text: str) -> tuple[GuidePage, ...]:
    nav = yaml.safe_load(config_text)["nav"]
    section = next(entry[GUIDE_SECTION] for entry in nav if isinstance(entry, dict) and GUIDE_SECTION in entry)
    pages = []
    for entry in section:
        (title, path), = entry.items()
        folder, _, file_name = str(path).rpartition("/")
        if folder != GUIDE_FOLDER or not file_name.endswith(".md"):
            raise ValueError(f"mkdocs.yml: the {GUIDE_SECTION} lists {path}, outside docs/{GUIDE_FOLDER}/")
        pages.append(GuidePage(name=file_name.removesuffix(".md"), title=str(title)))
    return tuple(pages)


def guide_pages() -> tuple[GuidePage, ...]:
    """The tenant guide's pages in the docs site's order (mkdocs.yml's nav)."""
    return _pages_of((_root() / "mkdocs.yml").read_text())


def _anchor(text: str) -> str:
    """MkDocs' heading anchor (Python-Markdown's toc slug): lowercase, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[\s-]+", "-", re.sub(r"[^\w\s-]", "", text.strip().lower()))


def _rewrite(tokens: list[Token]) -> None:
    """Anchors on headings; links to another page of the guide pointed at its dashboard route."""
    for index, token in enumerate(tokens):
        if token.type == "heading_open" and index + 1 < len(tokens):
            token.attrSet("id", _anchor(tokens[index + 1].content))
        for child in token.children or []:
            if child.type == "link_open":
                found = _GUIDE_LINK.match(str(child.attrGet("href") or ""))
                if found:
                    child.attrSet("href", reverse("dashboard:guide", args=[found.group(1)]) + (found.group(2) or ""))


def _html(text: str) -> str:
    tokens = _markdown.parse(text)
    _rewrite(tokens)
    rendered: str = _markdown.renderer.render(tokens, _markdown.options, {})
    return rendered


def _guide(request: DashboardRequest, name: str) -> HttpResponse:
    pages = guide_pages()
    page = next((page for page in pages if page.name == name), None)
    if not _NAME.match(name) or page is None:
        raise Http404(f"No guide '{escape(name)}'.")
    text = (_root() / "docs" / GUIDE_FOLDER / f"{name}.md").read_text()
    context: dict[str, Any] = {"guide": page, "body": _html(text), "pages": pages, "nav": "guides"}
    return render(request, "dashboard/guide.html", context)


@dashboard_view(Role.VIEWER)
def guide_view(request: DashboardRequest, name: str) -> HttpResponse:
    return _guide(request, name)


@dashboard_view(Role.VIEWER)
def guide_index_view(request: DashboardRequest) -> HttpResponse:
    """The guide's first page: the way from data to a served model, linking to the others."""
    return _guide(request, INDEX)
