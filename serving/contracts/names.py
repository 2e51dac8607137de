"""The qualified adapter name, `<tenant>/<adapter>@<version>`: how the registry, the gateway and the
serving workers name one version of one tenant's adapter (docs/registry.md), built and parsed here only.

`qualified_name()` is the one builder and `parse_qualified_name()` the one parser; both raise
ValueError naming what is wrong, so a malformed name never reaches a worker or a query. The parts
are read as the form requires: the tenant is everything before the first '/', the version everything
after the last '@', the adapter what lies between; none may be empty, and none may hold a '/' or an
'@' of its own (tenant slugs, adapter names and semantic versions never do).

`in_registry_form()` is deliberately broader than the parser: a worker reserves every name with a
'/' and then an '@' for the registry, so no near-miss spelling of a served version's name is left
for a caller to load under.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_REGISTRY_FORM = re.compile(r"[^/]*/.*@.*", re.DOTALL)


@dataclass(frozen=True)
class QualifiedName:
    """The three parts of `<tenant>/<adapter>@<version>`; `str()` gives the name back."""

    tenant: str
    adapter: str
    version: str

    def __str__(self) -> str:
        return qualified_name(tenant=self.tenant, adapter=self.adapter, version=self.version)


def _check_part(what: str, value: str, name: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"the qualified adapter name {name!r:.300} has an empty {what}; expected "
                         "<tenant>/<adapter>@<version>")
    for mark in ("/", "@"):
        if mark in value:
            raise ValueError(f"the {what} {value!r:.200} of the qualified adapter name {name!r:.300} contains "
                             f"{mark!r}; expected <tenant>/<adapter>@<version>")


def qualified_name(*, tenant: str, adapter: str, version: str) -> str:
    """`<tenant>/<adapter>@<version>`; ValueError naming an empty part or one holding '/' or '@'."""
    name = f"{tenant}/{adapter}@{version}"
    for what, value in (("tenant", tenant), ("adapter", adapter), ("version", version)):
        _check_part(what, value, name)
    return name


def name_prefix(*, tenant: str, adapter: str) -> str:
    """What every qualified name of one adapter starts with: `<tenant>/<adapter>@`."""
    for what, value in (("tenant", tenant), ("adapter", adapter)):
        _check_part(what, value, f"{tenant}/{adapter}@")
    return f"{tenant}/{adapter}@"


def parse_qualified_name(name: str) -> QualifiedName:
    """The parts of `<tenant>/<adapter>@<version>`; ValueError naming what is missing or misplaced."""
    if not isinstance(name, str):
        raise ValueError(f"a qualified adapter name must be a string, got {type(name).__name__}")
    tenant, slash, rest = name.partition("/")
    if not slash:
        raise ValueError(f"the qualified adapter name {name!r:.300} has no '/' after the tenant; expected "
                         "<tenant>/<adapter>@<version>")
    adapter, at, version = rest.rpartition("@")
    if not at:
        raise ValueError(f"the qualified adapter name {name!r:.300} has no '@' before the version; expected "
                         "<tenant>/<adapter>@<version>")
    for what, value in (("tenant", tenant), ("adapter", adapter), ("version", version)):
        _check_part(what, value, name)
    return QualifiedName(tenant=tenant, adapter=adapter, version=version)


def in_registry_form(name: str) -> bool:
    """Whether `name` claims the registry's form: any '/' followed later by an '@' (module docstring)."""
    return _REGISTRY_FORM.fullmatch(name) is not None
