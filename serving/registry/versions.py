"""Semantic versions of adapters: validation, precedence order, and the next patch release.

Build metadata (`+…`) is refused: semver ignores it in precedence, so `1.0.0+a` and `1.0.0+b`
would be two versions nobody can order, and `+` is awkward in URLs and storage keys.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import total_ordering

from serving.contracts.errors import InvalidInput

_NUMBER = r"0|[1-9]\d*"
_IDENTIFIER = r"0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*"
SEMVER_RE = re.compile(
    rf"^(?P<major>{_NUMBER})\.(?P<minor>{_NUMBER})\.(?P<patch>{_NUMBER})"
    rf"(?:-(?P<pre>(?:{_IDENTIFIER})(?:\.(?:{_IDENTIFIER}))*))?$"
)
# For URL routes: every character a valid version may contain.
VERSION_PATH_PATTERN = r"[0-9A-Za-z.\-]+"
FIRST_VERSION = "1.0.0"


@total_ordering
class SemVer:
    """A parsed version, ordered by semver precedence (a pre-release sorts before its release)."""

    __slots__ = ("major", "minor", "patch", "pre", "text")

    def __init__(self, text: str) -> None:
        match = SEMVER_RE.match(text)
        if match is None:
            raise ValueError(text)
        self.text = text
        self.major, self.minor, self.patch = (int(match[part]) for part in ("major", "minor", "patch"))
        self.pre: tuple[str, ...] = tuple(match["pre"].split(".")) if match["pre"] else ()

    @property
    def core(self) -> tuple[int, int, int]:
        return self.major, self.minor, self.patch

    def _key(self) -> tuple:
        # Numeric identifiers sort below alphanumeric ones; a release sorts above its pre-releases.
        pre = tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in self.pre)
        return self.core, (1,) if not self.pre else (0, pre)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SemVer) and self._key() == other._key()

    def __lt__(self, other: "SemVer") -> bool:
        return self._key() < other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __str__(self) -> str:
        return self.text


def version_parse(text: str) -> SemVer:
    """The parsed version, or InvalidInput saying what a valid one looks like."""
    if not isinstance(text, str) or not text:
        raise InvalidInput("A version is required, e.g. '1.0.0'.", code="invalid_version", param="version")
    if "+" in text:
        raise InvalidInput(
            f"Version '{text}' has build metadata ('+…'), which Loraplex does not accept: versions must "
            "differ in precedence. Use a pre-release instead, e.g. '1.2.0-rc.1'.",
            code="invalid_version", param="version",
        )
    try:
        return SemVer(text)
    except ValueError:
        raise InvalidInput(
            f"Version '{text}' is not a semantic version: use MAJOR.MINOR.PATCH with an optional "
            "pre-release, e.g. '1.2.0' or '1.3.0-rc.1' (no leading zeros, no 'v' prefix).",
            code="invalid_version", param="version",
        ) from None


def version_next_patch(existing: Iterable[str]) -> str:
    """The version a new release should take: the next patch after the highest existing one.

    If the highest core (major.minor.patch) exists only as pre-releases, the release of that core
    comes next (`1.1.0-rc.2` → `1.1.0`); with no versions at all it is FIRST_VERSION.
    """
    parsed = [SemVer(text) for text in existing if SEMVER_RE.match(text)]
    if not parsed:
        return FIRST_VERSION
    top_core = max(version.core for version in parsed)
    released = any(version.core == top_core and not version.pre for version in parsed)
    major, minor, patch = top_core
    return f"{major}.{minor}.{patch + 1}" if released else f"{major}.{minor}.{patch}"
