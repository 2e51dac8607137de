"""Validation of a tenant's uploaded PEFT adapter, before anything reaches storage or the database.

An upload is `adapter_config.json` + `adapter_model.safetensors` as multipart files, or one
`.zip` / `.tar.gz` holding them at its root. The files are unpacked into a private temporary
directory (each entry's name checked before its bytes: nothing is written outside it, no links, no
nested directories, a size cap that also bounds what a compressed archive expands to), then
checked by the serving engine's own adapter validator, the same code that will later load it, so
an adapter the registry accepts is one the engine can serve. That check reads the safetensors
header and the base model's config.json, never a tensor: this module (and so the web process)
imports neither torch nor transformers (tests/test_import_graph.py holds it). Pickled weights (`.bin`, `.pt`, …)
are refused by name and never opened.

Archives are read under a budget applied entry by entry, so a hostile one costs no more than the
budget: at most MAX_ARCHIVE_ENTRIES entries, and the sizes their headers declare (read or skipped)
within ADAPTER_MAX_BYTES; a .tar.gz is streamed, never listed whole first, and refused at the
first entry over either. `adapter_config.json` is read only within MAX_CONFIG_BYTES and
MAX_JSON_DEPTH, so a hostile config is a 400 naming the file, not a parser crash.
"""

from __future__ import annotations

import gzip
import json
import shutil
import stat
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path, PurePosixPath
from types import SimpleNamespace
from typing import IO, Any

from django.conf import settings
from django.core.files.uploadedfile import UploadedFile

from serving.contracts.errors import InvalidInput, NotFound, PayloadTooLarge, ServiceError
from serving.registry.storage import get_storage
from serving.engine.lora.reader import BaseShapes, validate_adapter_dir
from serving.contracts.artifact import (
    ADAPTER_CONFIG_NAME,
    MANIFEST_NAME,
    SOURCE_KINDS,
    AdapterError,
    adapter_digest,
    base_config_sha256,
    manifest_verify,
    manifest_write,
)
from serving.registry.selectors import accepted_base_models
from serving.contracts.names import qualified_name

WEIGHTS_NAME = "adapter_model.safetensors"
REQUIRED_FILES = (ADAPTER_CONFIG_NAME, WEIGHTS_NAME)
# PEFT's save_pretrained writes a model card; macOS archivers add their own metadata. Skipped.
SKIPPED_FILES = frozenset({"README.md", ".DS_Store"})
SKIPPED_DIRECTORY = "__MACOSX"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz")
# An adapter archive holds two files, perhaps a model card and an archiver's metadata: a few entries.
MAX_ARCHIVE_ENTRIES = 64
# PEFT's adapter_config.json is about 1 KB and two levels deep.
MAX_CONFIG_BYTES = 64 * 1024
MAX_JSON_DEPTH = 16
# What tar headers (pax, long names) may add to the declared entry sizes of a streamed .tar.gz.
_TAR_HEADER_ALLOWANCE = 1024 * 1024
_GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class StagedAdapter:
    """A validated adapter in a local directory, ready for its manifest and publication."""

    directory: Path
    rank: int
    lora_alpha: float
    target_modules: list[str] | str
    size_bytes: int
    kind: str = "lora"


@contextmanager
def staged_upload(files: Sequence[UploadedFile]) -> Iterator[StagedAdapter]:
    """Unpacks and validates an upload into a temporary directory, removed when the block ends.

    InvalidInput (or PayloadTooLarge) names the first problem found; nothing is kept.
    """
    workspace = Path(tempfile.mkdtemp(prefix="loraplex-upload-"))
    try:
        directory = workspace / "adapter"
        directory.mkdir()
        _collect(files, directory)
        yield _validate(directory)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)


@dataclass(frozen=True)
class PublishedArtifact:
    """What the registry records of an artifact verified in storage."""

    rank: int
    lora_alpha: float
    target_modules: list[str] | str
    size_bytes: int
    manifest_sha256: str
    source_kind: str
    source_id: str
    kind: str = "lora"


def manifest_write_for(staged: StagedAdapter, *, tenant: str, adapter: str, version: str) -> str:
    """Writes manifest.json into the staged directory; returns its sha256 (the content digest)."""
    manifest_write(
        staged.directory, tenant=tenant, name=adapter, version=version, base_model_name=settings.BASE_MODEL_NAME,
        base_config_sha256=base_config_sha256(Path(settings.BASE_MODEL_PATH)), source_kind="upload",
        source_id=qualified_name(tenant=tenant, adapter=adapter, version=version),
    )
    return adapter_digest(staged.directory)


def _mapping(value: object) -> dict[str, Any]:
    """A manifest section, or an empty one when it is missing or not a mapping (which then fails the checks)."""
    return value if isinstance(value, dict) else {}


def published_artifact_verify(*, prefix: str, tenant: str, adapter: str, version: str) -> PublishedArtifact:
    """Checks an artifact already in storage (a training job's) as thoroughly as an upload.

    It is copied to a temporary directory, every file is verified against manifest.json, the
    manifest must name this tenant, adapter and version and the platform's base model, and the
    engine's validator checks the adapter itself. InvalidInput names the first problem.
    """
    workspace = Path(tempfile.mkdtemp(prefix="loraplex-artifact-"))
    try:
        directory = workspace / "adapter"
        try:
            get_storage().download_prefix(prefix, directory)
        except NotFound:
            raise InvalidInput(f"No artifact is published at '{prefix}/'.", code="artifact_missing") from None
        try:
            manifest = manifest_verify(directory)
        except AdapterError as error:
            raise InvalidInput(f"The artifact at '{prefix}/' fails verification: {_plain(error, directory)}",
                               code="artifact_corrupt") from None
        expected = {"tenant": tenant, "name": adapter, "version": version}
        named = _mapping(manifest.get("adapter"))
        if {key: named.get(key) for key in expected} != expected:
            raise InvalidInput(f"The manifest at '{prefix}/' names {named}, not {expected}.", code="manifest_mismatch")
        if not isinstance(manifest.get("source"), dict) or manifest["source"].get("kind") not in SOURCE_KINDS:
            raise InvalidInput(f"The manifest at '{prefix}/' has no valid source (kind one of "
                               f"{', '.join(SOURCE_KINDS)}).", code="invalid_manifest")
        base = _mapping(manifest.get("base_model"))
        if base.get("name") not in accepted_base_models():
            raise InvalidInput(f"The artifact at '{prefix}/' was built for base model '{base.get('name')}', but this "
                               f"platform serves '{settings.BASE_MODEL_NAME}'.", code="base_model_mismatch")
        if base.get("config_sha256") != base_config_sha256(Path(settings.BASE_MODEL_PATH)):
            raise InvalidInput(f"The artifact at '{prefix}/' was built on a base model whose config differs from "
                               f"this platform's (config_sha256 {base.get('config_sha256')}).",
                               code="base_model_mismatch")
        staged = _validate(directory, check_config_base=False)
        return PublishedArtifact(
            rank=staged.rank, lora_alpha=staged.lora_alpha, target_modules=staged.target_modules,
            size_bytes=sum(entry["bytes"] for entry in manifest["files"].values()),
            manifest_sha256=adapter_digest(directory), source_kind=str(manifest["source"]["kind"]),
            source_id=str(manifest["source"].get("id") or ""), kind=staged.kind,
        )
    finally:
        shutil.rmtree(workspace, ignore_errors=True)


# --- collecting the files ---------------------------------------------------------------------


class _Budget:
    """Counts the bytes written for one upload and stops at ADAPTER_MAX_BYTES; for an archive, also
    its entries and the sizes they declare, refusing the first entry over either (module docstring)."""

    def __init__(self) -> None:
        self.limit = settings.ADAPTER_MAX_BYTES
        self.used = 0
        self.entries = 0
        self.declared = 0

    def admit(self, archive: str, entry: str, size: int) -> None:
        self.entries += 1
        if self.entries > MAX_ARCHIVE_ENTRIES:
            raise InvalidInput(f"'{archive}' has more than {MAX_ARCHIVE_ENTRIES} entries; an adapter archive holds "
                               f"{' and '.join(REQUIRED_FILES)}.", code="too_many_archive_entries")
        self.declared += max(0, size)
        if self.declared > self.limit:
            raise self.too_large(f" (at entry '{entry}' of '{archive}')")

    def too_large(self, where: str = "") -> PayloadTooLarge:
        return PayloadTooLarge(f"The adapter's files exceed the limit of {self.limit} bytes (ADAPTER_MAX_BYTES){where}.",
                               code="adapter_too_large")

    def copy(self, source: IO[bytes] | Iterator[bytes], target: Path) -> None:
        chunks = source if not hasattr(source, "read") else iter(lambda: source.read(_CHUNK), b"")
        with target.open("xb") as out:
            for chunk in chunks:
                self.used += len(chunk)
                if self.used > self.limit:
                    raise self.too_large()
                out.write(chunk)


class _BoundedStream:
    """A stream that refuses to yield more than `limit` bytes (what a .tar.gz may expand to, headers included)."""

    def __init__(self, stream: IO[bytes] | gzip.GzipFile, limit: int, budget: _Budget) -> None:
        self._stream = stream
        self._left = limit
        self._budget = budget

    def read(self, size: int = -1) -> bytes:
        chunk = self._stream.read(size if size >= 0 else self._left + 1)
        self._left -= len(chunk)
        if self._left < 0:
            raise self._budget.too_large()
        return chunk


def _is_archive(name: str) -> bool:
    return name.lower().endswith(ARCHIVE_SUFFIXES)


def _collect(files: Sequence[UploadedFile], directory: Path) -> None:
    if not files:
        raise InvalidInput(
            f"No files were uploaded: send {ADAPTER_CONFIG_NAME} and {WEIGHTS_NAME} as multipart files, "
            "or one .zip/.tar.gz with them at its root.", code="no_files",
        )
    budget = _Budget()
    if len(files) == 1 and _is_archive(archive_name := files[0].name or ""):
        if archive_name.lower().endswith(".zip"):
            _unpack_zip(files[0], archive_name, directory, budget)
        else:
            _unpack_tar(files[0], archive_name, directory, budget)
    else:
        archives = [upload.name for upload in files if _is_archive(upload.name or "")]
        if archives:
            raise InvalidInput(f"An archive ({archives[0]}) must be the only file of its upload.",
                               code="archive_not_alone")
        for upload in files:
            target = _target(upload.name or "", directory)
            if target is not None:
                budget.copy(upload.chunks(), target)
    missing = [name for name in REQUIRED_FILES if not (directory / name).is_file()]
    if missing:
        raise InvalidInput(
            f"The upload lacks {' and '.join(missing)}; a PEFT adapter needs {ADAPTER_CONFIG_NAME} and "
            f"{WEIGHTS_NAME} (save it with save_pretrained(..., safe_serialization=True)).",
            code="missing_files",
        )
    _check_json_limits(directory / ADAPTER_CONFIG_NAME)


def _check_json_limits(path: Path) -> None:
    """InvalidInput naming the file if it is larger or deeper than a config file can reasonably be.

    Only the limits are checked here; whether it is valid JSON and a valid config is the engine
    validator's to say (it reads the same bytes, now known to be small and shallow).
    """
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise InvalidInput(f"'{path.name}' is {size} bytes; at most {MAX_CONFIG_BYTES} are accepted.",
                           code="config_too_large", param="files")
    try:
        value = json.loads(path.read_bytes())
    except RecursionError:
        value = None
        deep = True
    except ValueError:
        return
    else:
        deep = _deeper_than(value, MAX_JSON_DEPTH)
    if deep:
        raise InvalidInput(f"'{path.name}' is nested deeper than {MAX_JSON_DEPTH} levels; a PEFT adapter config is "
                           "a flat object.", code="config_too_deep", param="files")


def _deeper_than(value: object, limit: int) -> bool:
    """Whether JSON `value` nests objects/arrays more than `limit` deep (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def _target(name: str, directory: Path) -> Path | None:
    """Where an accepted file goes; None for files that are skipped; InvalidInput otherwise."""
    if name in SKIPPED_FILES:
        return None
    if name.lower().endswith(PICKLE_SUFFIXES):
        raise InvalidInput(
            f"'{name}' is a pickled PyTorch file; Loraplex never loads pickles. Save the adapter as "
            f"safetensors ({WEIGHTS_NAME}) with save_pretrained(..., safe_serialization=True).",
            code="pickle_refused",
        )
    if name not in REQUIRED_FILES:
        raise InvalidInput(f"Unexpected file '{name}': an adapter upload holds only {' and '.join(REQUIRED_FILES)}.",
                           code="unexpected_file")
    target = directory / name
    if target.exists():
        raise InvalidInput(f"'{name}' was uploaded twice.", code="duplicate_file")
    return target


def _member_name(raw: str) -> str | None:
    """The file name of an archive entry at the root; None for entries that are skipped.

    Absolute paths, '..' segments and backslashes are refused before anything is read, so no entry
    can land outside the upload's directory; so are files in subdirectories (the files belong at
    the root).
    """
    if "\\" in raw or raw.startswith("/") or (len(raw) > 1 and raw[1] == ":"):
        raise InvalidInput(f"The archive entry '{raw}' has an absolute or Windows path; refused.",
                           code="unsafe_archive_path")
    parts = [part for part in PurePosixPath(raw).parts if part != "."]
    if ".." in parts:
        raise InvalidInput(f"The archive entry '{raw}' points outside the archive ('..'); refused.",
                           code="unsafe_archive_path")
    if not parts or parts[0] == SKIPPED_DIRECTORY:
        return None
    if len(parts) > 1:
        raise InvalidInput(
            f"The archive entry '{raw}' is in a subdirectory; put {' and '.join(REQUIRED_FILES)} at the archive's "
            "root (e.g. `cd my-adapter && zip ../my-adapter.zip *`).", code="archive_not_flat",
        )
    return parts[0]


def _unpack_zip(upload: UploadedFile, archive_name: str, directory: Path, budget: _Budget) -> None:
    try:
        archive = zipfile.ZipFile(upload)
    except (zipfile.BadZipFile, OSError):
        raise InvalidInput(f"'{archive_name}' is not a valid zip archive.", code="invalid_archive") from None
    with archive:
        entries = archive.infolist()
        for entry in entries:  # every name and size is checked before any byte is extracted
            budget.admit(archive_name, entry.filename, entry.file_size)
            _member_name(entry.filename)
        for entry in entries:
            name = _member_name(entry.filename)
            if name is None or entry.is_dir():
                continue
            if stat.S_ISLNK(entry.external_attr >> 16):
                raise InvalidInput(f"The archive entry '{entry.filename}' is a symbolic link; refused.",
                                   code="unsafe_archive_path")
            target = _target(name, directory)
            if target is None:
                continue
            try:
                with archive.open(entry) as stream:
                    budget.copy(stream, target)
            except (zipfile.BadZipFile, RuntimeError, OSError, EOFError) as error:
                raise InvalidInput(f"Could not unpack '{entry.filename}' from '{archive_name}': {error}.",
                                   code="invalid_archive") from None


def _unpack_tar(upload: UploadedFile, archive_name: str, directory: Path, budget: _Budget) -> None:
    """Streams the archive (tarfile's "r|" mode): each entry is admitted by the budget from its header,
    before its bytes are read or skipped; the decompressed stream itself is bounded as well."""
    upload.seek(0)
    compressed = upload.read(2) == _GZIP_MAGIC
    upload.seek(0)
    raw: IO[bytes] | gzip.GzipFile = gzip.GzipFile(fileobj=upload, mode="rb") if compressed else upload
    stream = _BoundedStream(raw, budget.limit + _TAR_HEADER_ALLOWANCE, budget)
    try:
        # Stream mode only reads its file; typeshed asks every mode for a seekable, writable one.
        archive = tarfile.open(fileobj=stream, mode="r|")  # type: ignore[call-overload]
    except (tarfile.TarError, OSError, EOFError, zlib.error):
        raise InvalidInput(f"'{archive_name}' is not a valid .tar.gz archive.", code="invalid_archive") from None
    with archive:
        try:
            for member in archive:
                budget.admit(archive_name, member.name, member.size)
                _unpack_tar_member(archive, member, archive_name, directory, budget)
        except (tarfile.TarError, OSError, EOFError, zlib.error) as error:
            raise InvalidInput(f"'{archive_name}' is not a valid .tar.gz archive: {error}.",
                               code="invalid_archive") from None


def _unpack_tar_member(archive: tarfile.TarFile, member: tarfile.TarInfo, archive_name: str, directory: Path,
                       budget: _Budget) -> None:
    name = _member_name(member.name)
    if name is None or member.isdir():
        return
    if not member.isfile():
        raise InvalidInput(f"The archive entry '{member.name}' is a link or special file; only regular "
                           "files are accepted.", code="unsafe_archive_path")
    target = _target(name, directory)
    if target is None:
        return
    stream = archive.extractfile(member)
    assert stream is not None, "a regular file (isfile above) always has its bytes"
    try:
        budget.copy(stream, target)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as error:
        raise InvalidInput(f"Could not unpack '{member.name}' from '{archive_name}': {error}.",
                           code="invalid_archive") from None
    finally:
        stream.close()


# --- validating the adapter -------------------------------------------------------------------


def _validate(directory: Path, *, check_config_base: bool = True) -> StagedAdapter:
    """The engine's checks of the adapter in `directory` against the platform's base model.

    With `check_config_base`, the base model adapter_config.json names must be an accepted one
    (the engine compares last path components). A training job's config names the local path it
    loaded the base from, so for its artifacts the manifest's base model is checked instead.
    """
    try:
        spec = validate_adapter_dir(
            directory, base_config=_base_shapes(Path(settings.BASE_MODEL_PATH)),
            max_lora_rank=settings.MAX_LORA_RANK,
            base_model_name=accepted_base_models() if check_config_base else None,
        )
    except AdapterError as error:
        raise InvalidInput(_plain(error, directory), code="invalid_adapter") from None
    return StagedAdapter(
        directory=directory, rank=spec.rank, lora_alpha=spec.lora_alpha, target_modules=sorted(spec.target_modules),
        size_bytes=sum(path.stat().st_size for path in directory.iterdir() if path.name != MANIFEST_NAME),
        kind=spec.kind,
    )


class BaseModelUnavailable(ServiceError):
    """The platform's own base model is missing, so no adapter can be checked against it."""

    status_code = 503
    code = "base_model_unavailable"


@lru_cache(maxsize=4)
def _base_shapes_cached(config_file: Path, mtime_ns: int) -> BaseShapes:
    """The shapes the engine reads from the same config.json through transformers' AutoConfig: the
    config.json of every architecture it serves spells out the fields BaseShapes reads (save_pretrained
    writes each field the model class adds; head_dim and num_key_value_heads fall back as transformers
    does, Gemma's head_dim to 256; model_type gives Phi-3 its fused qkv_proj and gate_up_proj)."""
    try:
        config = json.loads(config_file.read_bytes())
        if not isinstance(config, dict):
            raise TypeError("not a JSON object")
        return BaseShapes.from_config(SimpleNamespace(**config))
    except (ValueError, TypeError, AttributeError) as error:
        raise BaseModelUnavailable(
            f"The platform's base model config {config_file} (BASE_MODEL_PATH) cannot be read as a causal LM's "
            f"config ({error}), so adapters cannot be checked against it; ask the operator to fix it."
        ) from None


def _base_shapes(path: Path) -> BaseShapes:
    """The base model's layer count and module shapes (re-read when its config.json changes)."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise BaseModelUnavailable(
            f"The platform's base model is not available at {path} (BASE_MODEL_PATH), so adapters cannot be "
            "checked against it; ask the operator to install it."
        )
    return _base_shapes_cached(config_file, config_file.stat().st_mtime_ns)


def _plain(error: Exception, directory: Path) -> str:
    """The engine's message without the server's temporary path, which means nothing to a tenant."""
    return str(error).replace(f" in {directory}", "").replace(f"{directory}/", "").replace(str(directory), "the upload")
