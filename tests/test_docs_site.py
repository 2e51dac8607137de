"""The docs site (mkdocs.yml: the tenant and operator guides) builds with `mkdocs build --strict`, so a
broken link or anchor fails the suite; every Python sample in the guides compiles; and the figures
the guides state are the code's: the default tiers (tenants.tiers) and the request caps
(serving.contracts.request_caps). MkDocs runs in-process (its `build` with the CLI's `--strict`)."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pytest
from mkdocs.commands.build import build as mkdocs_build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort

from serving.contracts import request_caps
from tenants.tiers import DEFAULT_TIERS

ROOT = Path(__file__).resolve().parent.parent
GUIDES = [*sorted((ROOT / "docs" / "tenants").glob("*.md")), *sorted((ROOT / "docs" / "operators").glob("*.md"))]


def build(config_file: Path, site: Path) -> None:
    """`mkdocs build --strict --config-file <config_file> --site-dir <site>`; Abort on any warning."""
    mkdocs_build(load_config(config_file=str(config_file), strict=True, site_dir=str(site)))


def test_the_site_builds_strictly_with_both_guides_and_without_the_developers_notes(tmp_path):
    build(ROOT / "mkdocs.yml", tmp_path / "site")
    site = tmp_path / "site"
    for page in ("tenants/api", "tenants/keys-and-limits", "operators/install", "operators/backups"):
        assert (site / page / "index.html").is_file(), page
    assert "client.chat.completions.create" in (site / "tenants" / "api" / "index.html").read_text()
    assert not (site / "gateway").exists() and not (site / "screenshots").exists()


def test_a_broken_link_fails_the_build(tmp_path, caplog):
    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "docs", copy / "docs", ignore=shutil.ignore_patterns("screenshots"))
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    page = copy / "docs" / "tenants" / "training.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    with caplog.at_level(logging.WARNING, logger="mkdocs"), pytest.raises(Abort, match="strict mode"):
        build(copy / "mkdocs.yml", tmp_path / "site")
    assert "no-such-page.md" in caplog.text


@pytest.mark.parametrize("guide", GUIDES, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_every_python_sample_compiles(guide):
    for number, sample in enumerate(re.findall(r"```python\n(.*?)```", guide.read_text(), re.S)):
        compile(sample, f"{guide.name} sample {number}", "exec")


# A sample's address: `$LP/…` (LP=…/api/v1) or a full http://127.0.0.1:8000/… one.
# The samples' base URLs (`LP=…/api/v1`, the SDK's `base_url`): prefixes of routes, not routes.
BASE_URLS = {"/api/v1", "/v1", "/"}
_SAMPLE_PATH = re.compile(r"(?:\$LP|http://127\.0\.0\.1:8000)(/[\w./@-]*)")


def test_every_path_in_the_guides_samples_is_a_route_of_the_platform():
    from django.urls import Resolver404, resolve

    found = {("/api/v1" if match.group(0).startswith("$LP") else "") + match.group(1)
             for guide in GUIDES for match in _SAMPLE_PATH.finditer(guide.read_text())}
    assert "/api/v1/adapters/support-bot/canary/promote" in found and "/api/v1/datasets" in found
    missing = []
    for path in sorted(found - BASE_URLS):
        try:
            resolve(path)
        except Resolver404:
            missing.append(path)
    assert missing == []


def _table_rows(text: str, first_header: str) -> list[list[str]]:
    lines = text.splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_the_tier_table_is_the_default_tiers():
    rows = _table_rows((ROOT / "docs" / "tenants" / "keys-and-limits.md").read_text(), "tier")

    def number(cell: str) -> int:
        return int(cell.replace(",", ""))

    stated = {row[0]: (number(row[1]), number(row[2]), number(row[3]), number(row[4]), number(row[5]), row[6] == "yes")
              for row in rows}
    assert stated == {tier["name"]: (tier["requests_per_minute"], tier["tokens_per_minute"],
                                     tier["max_tokens_per_request"], tier["max_concurrent_training_jobs"],
                                     tier["max_adapters"], tier["degradation_allowed"]) for tier in DEFAULT_TIERS}


def test_the_request_size_table_is_the_request_caps():
    rows = dict(_table_rows((ROOT / "docs" / "tenants" / "keys-and-limits.md").read_text(), "field"))

    def numbers(field: str) -> list[int]:
        return [int(found.replace(",", "")) for found in re.findall(r"\d[\d,]*", rows[field])]

    assert numbers("`tools`") == [request_caps.MAX_TOOLS, request_caps.MAX_TOOL_SCHEMA_CHARS]
    assert numbers("`stop`") == [request_caps.MAX_STOP_STRINGS, request_caps.MAX_STOP_CHARS]
    assert numbers("`logit_bias`") == [request_caps.MAX_LOGIT_BIAS]
    assert numbers("`logprobs` (completions), `top_logprobs` (chat)") == [request_caps.MAX_LOGPROBS]
    assert numbers("`response_format`'s `json_schema` schema") == [request_caps.MAX_JSON_SCHEMA_CHARS]
    assert numbers("`model`") == [request_caps.MAX_MODEL_CHARS]
    assert numbers("the JSON body's nesting") == [request_caps.MAX_JSON_DEPTH]
