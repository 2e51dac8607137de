"""Blob storage for datasets, checkpoints and adapter artifacts: the interface and the local backend.

The one storage both sides read: the platform (serving.registry.storage.get_storage builds it from
settings) and the serving worker (serving.engine.lora.reader downloads an `s3://` artifact through
runtime.s3.S3Storage), so there is one S3 download path and one file layout. Django-free.

One small interface (`BlobStorage`) with two backends: `LocalStorage` (a directory; here) and
`S3Storage` (a bucket and base prefix; runtime.s3).

Keys are relative, `/`-separated paths (`adapters/acme/support-bot/1.0.0/manifest.json`).
A prefix names a directory: `list("adapters/acme")` sees `adapters/acme/…`, never `adapters/acme-2/…`.
A downloaded prefix keeps that layout: `<prefix>/<rel>` becomes `<local_dir>/<rel>`, and the
directory appears whole or not at all.

Every write is all-or-nothing: `put` streams into a temporary file (local) or a single upload that
S3 only makes visible once complete, hashing and counting as it goes, so a size limit trips without
leaving anything behind. `publish_directory` makes a whole directory appear at once; the protocol
(an artifact exists when its marker object exists) is described in docs/storage.md.

`uri()` gives paths that a serving worker or plain boto3 reads. Errors are serving.contracts.errors'
(InvalidInput, NotFound, Conflict, PayloadTooLarge), which the platform's API answers and the
worker's reader turns into its AdapterError.
"""

from __future__ import annotations

import builtins  # `builtins.list` in the classes, whose `list` method shadows the type
import hashlib
import io
import os
import shutil
import tempfile
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from serving.contracts.errors import Conflict, InvalidInput, NotFound, PayloadTooLarge

CHUNK_BYTES = 1024 * 1024
# Writes in progress live under this first key segment; listings never show it and keys may not use it.
STAGING_SEGMENT = ".loraplex-staging"

Source = bytes | bytearray | memoryview | BinaryIO | os.PathLike[str]


@dataclass(frozen=True)
class PutResult:
    key: str
    sha256: str
    size: int


def validate_key(key: str) -> str:
    """The key itself when it is a safe relative path; InvalidInput naming the problem otherwise."""
    if not isinstance(key, str) or not key:
        raise InvalidInput("A storage key must be a non-empty string.", code="invalid_storage_key")
    if key.startswith("/"):
        raise InvalidInput(f"Storage key '{key}' must be relative (no leading '/').", code="invalid_storage_key")
    if "\\" in key or "\x00" in key:
        raise InvalidInput(f"Storage key '{key}' contains a backslash or NUL character.",
                           code="invalid_storage_key")
    segments = key.split("/")
    if any(segment in ("", ".", "..") for segment in segments):
        raise InvalidInput(f"Storage key '{key}' has an empty, '.' or '..' segment.", code="invalid_storage_key")
    if segments[0] == STAGING_SEGMENT:
        raise InvalidInput(f"Storage keys may not start with the reserved '{STAGING_SEGMENT}/'.",
                           code="invalid_storage_key")
    return key


def validate_prefix(prefix: str, *, allow_root: bool = False) -> str:
    """A prefix without its trailing '/', or '' for the whole storage when allowed."""
    stripped = prefix.rstrip("/") if isinstance(prefix, str) else prefix
    if stripped == "" and allow_root:
        return ""
    if stripped == "":
        raise InvalidInput("This operation needs a non-empty prefix.", code="invalid_storage_key")
    return validate_key(stripped)


class HashingReader:
    """Reads a source in order, hashing and counting; raises PayloadTooLarge past max_bytes.

    It deliberately has no seek/tell, so boto3's transfer manager reads it strictly in order.
    """

    def __init__(self, stream: BinaryIO, max_bytes: int | None) -> None:
        self._stream = stream
        self._max_bytes = max_bytes
        self._digest = hashlib.sha256()
        self.size = 0

    def read(self, size: int = -1) -> bytes:
        """Up to size bytes (all that is left when size < 0), short only at the end of the stream.

        Network and raw streams may return less than asked; boto3 takes a short read for the end.
        """
        wanted = size if size is not None and size >= 0 else None
        parts: list[bytes] = []
        got = 0
        while wanted is None or got < wanted:
            chunk = self._stream.read(CHUNK_BYTES if wanted is None else wanted - got)
            if not chunk:
                break
            if not isinstance(chunk, (bytes, bytearray)):
                raise InvalidInput("The upload source must yield bytes (open files in binary mode).")
            self.size += len(chunk)
            if self._max_bytes is not None and self.size > self._max_bytes:
                raise PayloadTooLarge(
                    f"The upload is larger than the limit of {self._max_bytes} bytes.", code="payload_too_large"
                )
            self._digest.update(chunk)
            parts.append(bytes(chunk))
            got += len(chunk)
        return b"".join(parts)

    @property
    def sha256(self) -> str:
        return self._digest.hexdigest()


def open_source(source: Source) -> BinaryIO:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return io.BytesIO(bytes(source))
    if isinstance(source, os.PathLike):
        return Path(source).open("rb")
    if hasattr(source, "read"):
        return source
    raise InvalidInput(f"Cannot store a {type(source).__name__}: pass bytes, a binary file or a Path.")


def file_digest(path: Path) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _publishable_files(local_dir: Path, marker: str) -> list[tuple[str, Path]]:
    """(relative key, path) of every file under local_dir, sorted, the marker last."""
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise InvalidInput(f"Cannot publish '{local_dir}': not a directory.")
    files: list[tuple[str, Path]] = []
    for path in sorted(local_dir.rglob("*")):
        if path.is_dir():
            continue
        if not path.is_file():
            raise InvalidInput(f"Cannot publish '{path}': not a regular file.")
        files.append((validate_key(path.relative_to(local_dir).as_posix()), path))
    if not any(rel == marker for rel, _ in files):
        raise InvalidInput(f"Cannot publish '{local_dir}': it has no '{marker}', the file that marks an "
                           "artifact as complete.", code="missing_marker")
    files.sort(key=lambda item: item[0] == marker)
    return files


def _write_local(target: Path, reader: HashingReader) -> None:
    """Copies the reader into target (a new file), flushed to disk."""
    with target.open("xb") as handle:
        while chunk := reader.read(CHUNK_BYTES):
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())


class BlobStorage(ABC):
    """The storage interface every part of the platform uses; see the module docstring."""

    @abstractmethod
    def put(self, key: str, source: Source, *, max_bytes: int | None = None) -> PutResult:
        """Stores source under key (replacing it), all or nothing; PayloadTooLarge past max_bytes."""

    @abstractmethod
    def open(self, key: str) -> BinaryIO:
        """A binary stream of the object; NotFound if it does not exist. Close it when done."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys under the prefix (a directory; '' for everything)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Deletes the object; deleting a missing key is not an error."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Deletes every object under the prefix; how many there were."""

    @abstractmethod
    def uri(self, key: str) -> str:
        """`file:///abs/path` or `s3://bucket/key`: readable without Django (serving workers, boto3)."""

    @abstractmethod
    def _publish(
        self, files: builtins.list[tuple[str, Path]], prefix: str, marker: str
    ) -> builtins.list[PutResult]: ...

    def get_bytes(self, key: str) -> bytes:
        with self.open(key) as stream:
            return stream.read()

    def download(self, key: str, path: Path) -> Path:
        """Copies the object to path (parents created); the file appears complete or not at all."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}.part")
        try:
            with self.open(key) as stream, partial.open("wb") as handle:
                shutil.copyfileobj(stream, handle, CHUNK_BYTES)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        return path

    def download_prefix(self, prefix: str, local_dir: Path, *, flat: bool = False) -> builtins.list[Path]:
        """Copies every object under prefix into local_dir (which must not exist), keeping the layout.

        The objects are fetched into a sibling temporary directory renamed to local_dir at the end,
        so local_dir appears complete or not at all. NotFound when nothing is stored there; with
        `flat`, InvalidInput (code nested_object) names the first object in a subdirectory before
        anything is fetched (an adapter artifact is one flat directory).
        """
        prefix = validate_prefix(prefix)
        local_dir = Path(local_dir)
        if local_dir.exists():
            raise Conflict(f"Cannot download '{prefix}/' to '{local_dir}': it exists already.",
                           code="download_target_exists")
        local_dir.parent.mkdir(parents=True, exist_ok=True)
        keys = self.list(prefix)
        if not keys:
            raise NotFound(f"Nothing is stored under '{prefix}/'.", code="storage_prefix_not_found")
        names = [key[len(prefix) + 1:] for key in keys]
        nested = next((key for key, name in zip(keys, names, strict=True) if "/" in name), None) if flat else None
        if nested is not None:
            raise InvalidInput(f"{self.uri(nested)} is nested under {self.uri(prefix)}/, where a flat directory "
                               "was asked for", code="nested_object")
        staging = Path(tempfile.mkdtemp(prefix=f".{local_dir.name}.", dir=local_dir.parent))
        try:
            for key, name in zip(keys, names, strict=True):
                self.download(key, staging / name)
            staging.chmod(0o755)  # mkdtemp's 0700 would hide the directory from other users
            os.rename(staging, local_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return [local_dir / name for name in names]

    def publish_directory(
        self, local_dir: Path, prefix: str, *, marker: str = "manifest.json"
    ) -> builtins.list[PutResult]:
        """Publishes local_dir's files under prefix at once, the marker last; Conflict if already there.

        Readers treat `<prefix>/<marker>` as the sign that the artifact is complete. Whatever was
        under the prefix without a marker is debris of an interrupted publish and is replaced. On
        any failure, everything this call wrote is deleted.
        """
        prefix = validate_prefix(prefix)
        files = _publishable_files(Path(local_dir), marker)
        if self.exists(f"{prefix}/{marker}"):
            raise Conflict(f"An artifact is already published at '{prefix}/'; publish a new version instead.",
                           code="artifact_exists")
        return self._publish(files, prefix, marker)


class LocalStorage(BlobStorage):
    """Objects are files under one root directory."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self._staging = self.root / STAGING_SEGMENT

    def _path(self, key: str) -> Path:
        return self.root / validate_key(key)

    def _staging_path(self) -> Path:
        self._staging.mkdir(exist_ok=True)
        return self._staging / uuid.uuid4().hex

    def put(self, key: str, source: Source, *, max_bytes: int | None = None) -> PutResult:
        target = self._path(key)
        partial = self._staging_path()
        stream = open_source(source)
        try:
            reader = HashingReader(stream, max_bytes)
            _write_local(partial, reader)
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_dir():
                raise Conflict(f"Cannot store '{key}': it is a prefix holding other objects.")
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
            if stream is not source:
                stream.close()
        return PutResult(key=key, sha256=reader.sha256, size=reader.size)

    def open(self, key: str) -> BinaryIO:
        path = self._path(key)
        try:
            return path.open("rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFound(f"No stored object '{key}'.", code="storage_object_not_found") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def _files(self, prefix: str) -> Iterator[Path]:
        base = self.root / prefix if prefix else self.root
        if not base.is_dir():
            return
        for path in base.rglob("*"):
            if path.is_file() and not (not prefix and path.relative_to(self.root).parts[0] == STAGING_SEGMENT):
                yield path

    def list(self, prefix: str = "") -> list[str]:
        prefix = validate_prefix(prefix, allow_root=True)
        return sorted(path.relative_to(self.root).as_posix() for path in self._files(prefix))

    def _prune_empty_parents(self, path: Path) -> None:
        """Removes directories left empty, so a prefix with no objects leaves no trace."""
        for parent in path.parents:
            if parent == self.root or self.root not in parent.parents:
                return
            try:
                parent.rmdir()
            except OSError:
                return

    def delete(self, key: str) -> None:
        path = self._path(key)
        if path.is_file():
            path.unlink(missing_ok=True)
            self._prune_empty_parents(path)

    def delete_prefix(self, prefix: str) -> int:
        prefix = validate_prefix(prefix)
        base = self.root / prefix
        if not base.is_dir():
            return 0
        count = sum(1 for _ in self._files(prefix))
        shutil.rmtree(base)
        self._prune_empty_parents(base)
        return count

    def uri(self, key: str) -> str:
        return self._path(key).as_uri()

    def _publish(self, files: builtins.list[tuple[str, Path]], prefix: str, marker: str) -> builtins.list[PutResult]:
        # The directory is assembled beside the root and renamed into place in one step.
        staging = self._staging_path()
        final = self.root / prefix
        try:
            staging.mkdir()
            results = []
            for rel, path in files:
                (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                with path.open("rb") as stream:
                    reader = HashingReader(stream, None)
                    _write_local(staging / rel, reader)
                results.append(PutResult(key=f"{prefix}/{rel}", sha256=reader.sha256, size=reader.size))
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():
                if (final / marker).is_file():
                    raise Conflict(f"An artifact is already published at '{prefix}/'.", code="artifact_exists")
                shutil.rmtree(final)
            try:
                os.rename(staging, final)
            except OSError:
                # Another publisher renamed its directory into place between our check and ours.
                raise Conflict(f"An artifact was published at '{prefix}/' concurrently.",
                               code="artifact_exists") from None
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            self._prune_empty_parents(final)
            raise
        return results
