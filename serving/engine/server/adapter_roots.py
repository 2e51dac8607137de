"""Where the worker may load adapters from: the platform's storage, plus the roots an operator adds
with `--allowed-adapter-path` (as vLLM's `--allowed-local-media-path`).

A location given to `/v1/load_lora_adapter` or by the registry is checked here before anything
reads it. Outside every root, the one refusal is the same whether the location exists, is a file,
holds no adapter or names a bucket the worker's credentials cannot read: a caller learns nothing
about the machine or the account. Local paths are compared after resolving symlinks and `..`, and
the resolved path is what gets loaded, so a link inside a root cannot lead out of it.
`--lora-modules` are the operator's own command line and are not checked.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from serving.contracts.artifact import AdapterError
from runtime.settings import platform_settings

# Relative local roots are taken from the project directory (as the platform's storage URL is).
PROJECT_DIR = Path(__file__).resolve().parents[3]


class AdapterLocationRefused(AdapterError):
    """A location outside every allowed root; the message is the same for all of them."""


@dataclass(frozen=True)
class _S3Root:
    bucket: str
    prefix: str  # no leading or trailing '/'; '' for the whole bucket

    def covers(self, bucket: str, key: str) -> bool:
        return bucket == self.bucket and (not self.prefix or key == self.prefix or key.startswith(f"{self.prefix}/"))

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def platform_storage_url() -> str:
    """The platform's storage as the web app sees it: STORAGE_URL, else its default (the settings',
    runtime.settings)."""
    return platform_settings().storage_url


def _local(location: str) -> Path | None:
    """The local path a location names (a path or a file:// URI), or None for anything else."""
    if location.startswith("file://"):
        parsed = urlparse(location)
        if parsed.netloc not in ("", "localhost"):
            return None
        return Path(unquote(parsed.path))
    if "://" in location:
        return None
    return Path(location)


def _s3(location: str) -> tuple[str, str] | None:
    """(bucket, key prefix) of an s3:// URI whose key has no empty, '.' or '..' segment."""
    if not location.startswith("s3://"):
        return None
    bucket, _, key = location[len("s3://"):].partition("/")
    key = key.rstrip("/")
    if not bucket or key and any(part in ("", ".", "..") for part in key.split("/")):
        return None
    return bucket, key


class AdapterRoots:
    """The allowed roots; `check` maps an allowed location to what to load, refuses any other."""

    def __init__(self, roots: Sequence[str], *, base_dir: Path = PROJECT_DIR) -> None:
        self._local: list[Path] = []
        self._s3: list[_S3Root] = []
        for root in roots:
            s3 = _s3(root)
            if s3 is not None:
                self._s3.append(_S3Root(*s3))
            elif root.startswith("file://") or "://" not in root:
                # file://var/storage is relative to the project, as STORAGE_URL reads it.
                path = Path(unquote(root.removeprefix("file://")))
                self._local.append(Path(os.path.realpath(path if path.is_absolute() else base_dir / path)))
            else:
                raise ValueError(f"allowed adapter path {root!r}: use a directory, file:///path or s3://bucket[/prefix]")

    @property
    def roots(self) -> list[str]:
        return [str(path) for path in self._local] + [str(root) for root in self._s3]

    def check(self, location: str) -> str:
        """The location to load (a resolved local path, or the s3:// URI as given); raises
        AdapterLocationRefused, always with the same message, when no root covers it."""
        s3 = _s3(location)
        if s3 is not None:
            if any(root.covers(*s3) for root in self._s3):
                return location
            raise self._refused(location)
        path = _local(location)
        if path is not None:
            try:
                resolved = Path(os.path.realpath(path))
            except (ValueError, OSError):  # a NUL byte, a symlink loop
                raise self._refused(location) from None
            if path.is_absolute() and any(resolved.is_relative_to(root) for root in self._local):
                return str(resolved)
        raise self._refused(location)

    @staticmethod
    def _refused(location: str) -> AdapterLocationRefused:
        return AdapterLocationRefused(
            f"{location!r} is not in an allowed adapter location (the worker loads adapters from the "
            "platform's storage and the operator's --allowed-adapter-path roots only)"
        )
