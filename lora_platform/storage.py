"""Blob storage for datasets, checkpoints and adapter artifacts: a local directory or S3.

One small interface (`BlobStorage`) with two backends chosen by `STORAGE_URL`:
`file:///abs/path` or `file://relative/path` (relative to the project directory) and
`s3://bucket/prefix` (boto3; `S3_ENDPOINT_URL` for MinIO, credentials from the usual `AWS_*`).

Keys are relative, `/`-separated paths (`adapters/acme/support-bot/1.0.0/manifest.json`).
A prefix names a directory: `list("adapters/acme")` sees `adapters/acme/…`, never `adapters/acme-2/…`.

Every write is all-or-nothing: `put` streams into a temporary file (local) or a single upload that
S3 only makes visible once complete, hashing and counting as it goes, so a size limit trips without
leaving anything behind. `publish_directory` makes a whole directory appear at once; the protocol
(an artifact exists when its marker object exists) is described in docs/storage.md.

This module imports Django only inside `get_storage`, and `uri()` gives paths that a serving worker
or plain boto3 reads without it.
"""

from __future__ import annotations

import builtins  # `builtins.list` in the classes, whose `list` method shadows the type
import hashlib
import io
import os
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import BinaryIO

from lora_platform.errors import Conflict, InvalidInput, NotFound, PayloadTooLarge

CHUNK_BYTES = 1024 * 1024
# Writes in progress live under this first key segment; listings never show it and keys may not use it.
STAGING_SEGMENT = ".loraplex-staging"

Source = bytes | bytearray | memoryview | BinaryIO | os.PathLike


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


class _HashingReader:
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


def _open_source(source: Source) -> BinaryIO:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return io.BytesIO(bytes(source))
    if isinstance(source, os.PathLike):
        return Path(source).open("rb")
    if hasattr(source, "read"):
        return source
    raise InvalidInput(f"Cannot store a {type(source).__name__}: pass bytes, a binary file or a Path.")


def _file_digest(path: Path) -> tuple[str, int]:
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


def _write_local(target: Path, reader: _HashingReader) -> None:
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

    def download_prefix(self, prefix: str, local_dir: Path) -> builtins.list[Path]:
        """Copies every object under prefix into local_dir, keeping the relative layout."""
        prefix = validate_prefix(prefix)
        keys = self.list(prefix)
        if not keys:
            raise NotFound(f"Nothing is stored under '{prefix}/'.", code="storage_prefix_not_found")
        return [self.download(key, Path(local_dir) / key[len(prefix) + 1:]) for key in keys]

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
        stream = _open_source(source)
        try:
            reader = _HashingReader(stream, max_bytes)
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
                    reader = _HashingReader(stream, None)
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


class S3Storage(BlobStorage):
    """Objects under `s3://bucket/base-prefix/`. Each put is one (possibly multipart) upload."""

    def __init__(self, bucket: str, base_prefix: str = "", *, endpoint_url: str | None = None) -> None:
        import boto3
        from botocore.config import Config

        if not bucket:
            raise InvalidInput("An S3 storage URL needs a bucket: s3://bucket[/prefix].")
        self.bucket = bucket
        self.base = f"{validate_prefix(base_prefix)}/" if base_prefix.strip("/") else ""
        # MinIO and moto serve buckets by path, not by virtual host.
        config = Config(s3={"addressing_style": "path"}) if endpoint_url else None
        self.client = boto3.client("s3", endpoint_url=endpoint_url, config=config)

    def _full(self, key: str) -> str:
        return self.base + key

    def _upload(self, full_key: str, reader: _HashingReader, metadata: dict[str, str]) -> None:
        # upload_fileobj aborts a multipart upload that fails, so a failed put leaves nothing.
        self.client.upload_fileobj(reader, self.bucket, full_key, ExtraArgs={"Metadata": metadata})

    def put(self, key: str, source: Source, *, max_bytes: int | None = None) -> PutResult:
        validate_key(key)
        metadata: dict[str, str] = {}
        if isinstance(source, os.PathLike):
            # Hashing the file first lets the object carry its digest, which publish verifies.
            digest, size = _file_digest(Path(source))
            if max_bytes is not None and size > max_bytes:
                raise PayloadTooLarge(f"The upload is {size} bytes; the limit is {max_bytes} bytes.")
            metadata["sha256"] = digest
        elif isinstance(source, (bytes, bytearray, memoryview)):
            metadata["sha256"] = hashlib.sha256(source).hexdigest()
        stream = _open_source(source)
        try:
            reader = _HashingReader(stream, max_bytes)
            self._upload(self._full(key), reader, metadata)
        finally:
            if stream is not source:
                stream.close()
        if metadata and metadata["sha256"] != reader.sha256:
            self.client.delete_object(Bucket=self.bucket, Key=self._full(key))
            # Only a Path or a mutable buffer gets here; a buffer's repr would put its bytes in the message.
            what = f"'{source}'" if isinstance(source, os.PathLike) else "The buffer"
            raise Conflict(f"{what} changed while it was being stored; nothing was kept.")
        return PutResult(key=key, sha256=reader.sha256, size=reader.size)

    def open(self, key: str) -> BinaryIO:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._full(validate_key(key)))["Body"]
        except self.client.exceptions.NoSuchKey:
            raise NotFound(f"No stored object '{key}'.", code="storage_object_not_found") from None

    def exists(self, key: str) -> bool:
        return self._head(self._full(validate_key(key))) is not None

    def _head(self, full_key: str) -> dict | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.head_object(Bucket=self.bucket, Key=full_key)
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def _list_full(self, full_prefix: str) -> builtins.list[str]:
        keys: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full_prefix):
            keys.extend(item["Key"] for item in page.get("Contents", []))
        return keys

    def list(self, prefix: str = "") -> list[str]:
        prefix = validate_prefix(prefix, allow_root=True)
        keys = (full[len(self.base):] for full in self._list_full(self.base + (f"{prefix}/" if prefix else "")))
        return sorted(key for key in keys if key.split("/", 1)[0] != STAGING_SEGMENT)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._full(validate_key(key)))

    def _delete_full(self, full_keys: builtins.list[str]) -> None:
        for start in range(0, len(full_keys), 1000):  # the DeleteObjects limit
            batch = [{"Key": key} for key in full_keys[start:start + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})

    def delete_prefix(self, prefix: str) -> int:
        keys = self._list_full(self.base + validate_prefix(prefix) + "/")
        self._delete_full(keys)
        return len(keys)

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._full(validate_key(key))}"

    def _publish(self, files: builtins.list[tuple[str, Path]], prefix: str, marker: str) -> builtins.list[PutResult]:
        # S3 has no rename: stage, verify, copy into place with the marker last, drop the stage.
        staging = f"{self.base}{STAGING_SEGMENT}/{uuid.uuid4().hex}/"
        final = f"{self.base}{prefix}/"
        copied: list[str] = []
        try:
            staged: list[tuple[str, PutResult]] = []
            for rel, path in files:
                digest, size = _file_digest(path)
                with path.open("rb") as stream:
                    reader = _HashingReader(stream, None)
                    self._upload(staging + rel, reader, {"sha256": digest})
                if (reader.sha256, reader.size) != (digest, size):
                    raise Conflict(f"'{path}' changed while it was being published; nothing was kept.")
                staged.append((rel, PutResult(key=f"{prefix}/{rel}", sha256=digest, size=size)))
            for rel, result in staged:
                head = self._head(staging + rel)
                if head is None or head["ContentLength"] != result.size or head["Metadata"].get("sha256") != result.sha256:
                    raise Conflict(f"Staged copy of '{rel}' does not match the source (size or sha256); "
                                   "nothing was published.", code="publish_verification_failed")
            # Objects under the prefix without a marker are debris of an interrupted publish.
            self._delete_full(self._list_full(final))
            for rel, _ in staged:
                self.client.copy({"Bucket": self.bucket, "Key": staging + rel}, self.bucket, final + rel)
                copied.append(final + rel)
        except BaseException:
            self._delete_full(copied)
            raise
        finally:
            self._delete_full(self._list_full(staging))
        return [result for _, result in staged]


def storage_from_url(url: str, *, endpoint_url: str | None = None, base_dir: Path | None = None) -> BlobStorage:
    """The backend a storage URL names; relative `file://` paths are taken from base_dir (or cwd)."""
    if url.startswith("file://"):
        path = Path(url[len("file://"):])
        if not path.is_absolute():
            path = Path(base_dir or Path.cwd()) / path
        return LocalStorage(path)
    if url.startswith("s3://"):
        bucket, _, base_prefix = url[len("s3://"):].partition("/")
        return S3Storage(bucket, base_prefix, endpoint_url=endpoint_url)
    raise InvalidInput(f"Unsupported STORAGE_URL '{url}': use file:///path, file://relative/path or "
                       "s3://bucket[/prefix].", code="invalid_storage_url")


@lru_cache(maxsize=8)
def _cached_storage(url: str, endpoint_url: str | None, base_dir: Path) -> BlobStorage:
    return storage_from_url(url, endpoint_url=endpoint_url, base_dir=base_dir)


def get_storage() -> BlobStorage:
    """The platform's storage, from settings.STORAGE_URL and settings.S3_ENDPOINT_URL."""
    from django.conf import settings

    return _cached_storage(settings.STORAGE_URL, settings.S3_ENDPOINT_URL, Path(settings.BASE_DIR))
