"""The Guides page serves the tenant guide (issue 39, item 7): docs/tenants/ in the docs site's order
(mkdocs.yml's "Tenant guide"), with links between its pages and to their headings working in the
dashboard; the developers' notes (docs/*.md: file paths, test names) are not served to tenants."""

from __future__ import annotations

import re

import pytest
import yaml
from django.conf import settings
from django.urls import reverse

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fast_passwords")]


def tenant_nav() -> list[tuple[str, str]]:
    nav = yaml.safe_load((settings.BASE_DIR / "mkdocs.yml").read_text())["nav"]
    section = next(entry["Tenant guide"] for entry in nav if isinstance(entry, dict) and "Tenant guide" in entry)
    return [next(iter(entry.items())) for entry in section]


def test_the_guides_page_is_the_tenant_guide_in_the_sites_order(as_user, people):
    page = as_user(people.viewer).get(reverse("dashboard:guides")).content.decode()
    assert '<h1 id="getting-started">Getting started</h1>' in page
    sidebar = page[page.index('aria-label="Guides"'):]
    listed = re.findall(r'<li><a href="/guides/([a-z-]+)/"[^>]*>([^<]+)</a>', sidebar)
    assert listed == [(path.removeprefix("tenants/").removesuffix(".md"), title) for title, path in tenant_nav()]
    assert not re.search(r"docs/[\w/-]*\.md", page)  # no repository paths in front of tenants


def test_links_between_pages_land_on_the_page_and_its_heading(as_user, people):
    client = as_user(people.viewer)
    training = client.get(reverse("dashboard:guide", args=["datasets"])).content.decode()
    assert 'href="/guides/training/#methods"' in training
    target = client.get(reverse("dashboard:guide", args=["training"])).content.decode()
    assert '<h2 id="methods">Methods</h2>' in target
    assert '<h2 id="with-the-openai-sdk">With the OpenAI SDK</h2>' in target


def test_the_developers_notes_are_not_served(as_user, people):
    client = as_user(people.viewer)
    for name in ("gateway", "testing", "dashboard", "no-such-guide"):
        assert client.get(reverse("dashboard:guide", args=[name])).status_code == 404


def test_the_pages_link_to_the_guide_of_what_they_show(as_user, people):
    client = as_user(people.member)
    for route, guide in (("dashboard:keys", "keys-and-limits"), ("dashboard:datasets", "datasets"),
                         ("dashboard:job-new", "training"), ("dashboard:playground", "api")):
        page = client.get(reverse(route)).content.decode()
        assert f'href="/guides/{guide}/' in page, route
        assert client.get(reverse("dashboard:guide", args=[guide])).status_code == 200
