"""The qualified adapter name (serving.contracts.names): one builder, one parser, and errors that say what is wrong."""

from __future__ import annotations

import pytest

from serving.contracts.names import (
    QualifiedName,
    in_registry_form,
    name_prefix,
    parse_qualified_name,
    qualified_name,
)


@pytest.mark.parametrize("parts", [("alice-co", "support-bot", "1.2.0"), ("t", "a", "1.0.0-rc.1+build.5")])
def test_built_names_parse_back_to_their_parts(parts: tuple[str, str, str]) -> None:
    tenant, adapter, version = parts
    name = qualified_name(tenant=tenant, adapter=adapter, version=version)

    assert name == f"{tenant}/{adapter}@{version}"
    assert parse_qualified_name(name) == QualifiedName(tenant, adapter, version)
    assert str(parse_qualified_name(name)) == name
    assert name.startswith(name_prefix(tenant=tenant, adapter=adapter))


@pytest.mark.parametrize(("name", "problem"), [
    ("support-bot@1.0.0", r"no '/' after the tenant"),
    ("alice-co/support-bot", r"no '@' before the version"),
    ("/support-bot@1.0.0", r"empty tenant"),
    ("alice-co/@1.0.0", r"empty adapter"),
    ("alice-co/support-bot@", r"empty version"),
    ("alice-co/team/bot@1.0.0", r"the adapter 'team/bot' .* contains '/'"),
    ("alice-co/bot@x@1.0.0", r"the adapter 'bot@x' .* contains '@'"),
    ("a@b/bot@1.0.0", r"the tenant 'a@b' .* contains '@'"),
    ("", r"no '/' after the tenant"),
])
def test_the_parser_names_what_is_wrong(name: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_qualified_name(name)


def test_the_parser_refuses_what_is_not_a_string() -> None:
    with pytest.raises(ValueError, match="must be a string, got int"):
        parse_qualified_name(42)  # type: ignore[arg-type]


@pytest.mark.parametrize(("parts", "problem"), [
    ({"tenant": "", "adapter": "bot", "version": "1.0.0"}, r"empty tenant"),
    ({"tenant": "t", "adapter": "", "version": "1.0.0"}, r"empty adapter"),
    ({"tenant": "t", "adapter": "bot", "version": ""}, r"empty version"),
    ({"tenant": "t/u", "adapter": "bot", "version": "1.0.0"}, r"the tenant 't/u' .* contains '/'"),
    ({"tenant": "t", "adapter": "b@t", "version": "1.0.0"}, r"the adapter 'b@t' .* contains '@'"),
    ({"tenant": "t", "adapter": "bot", "version": "1@0"}, r"the version '1@0' .* contains '@'"),
])
def test_the_builder_refuses_parts_that_would_not_parse_back(parts: dict[str, str], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        qualified_name(**parts)
    with pytest.raises(ValueError):
        QualifiedName(**parts).__str__()


def test_registry_form_is_broader_than_the_parser() -> None:
    # Reserved for the registry on a worker even where the parser refuses them: no near-miss is left.
    for near_miss in ("alice-co/team/bot@1.0.0", "/bot@", "t/@", "a/b\n@c"):
        assert in_registry_form(near_miss)
    for other in ("support-bot", "bot@1.0.0", "alice-co/bot", "a@b/c"):
        assert not in_registry_form(other)
