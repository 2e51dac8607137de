"""The S3 backend of the blob storage (runtime.storage): objects under `s3://bucket/base-prefix/`.

boto3 throughout: `endpoint_url` (S3_ENDPOINT_URL) for MinIO or moto, credentials from boto3's
usual sources (`AWS_*`). boto3 is imported when an S3Storage is made, so a process on a local
directory never loads it. `S3Storage.at(uri)` is how a reader of `uri()`'s result (the serving
worker, given an artifact URI by the registry) gets back the storage and the key.
"""

from __future__ import annotations

import builtins  # `builtins.list` in the class, whose `list` method shadows the type
import hashlib
import os
import uuid
from pathlib import Path
from typing import Any, BinaryIO, cast
from urllib.parse import urlparse

from serving.contracts.errors import Conflict, InvalidInput, NotFound, PayloadTooLarge
from runtime.storage import (
    STAGING_SEGMENT,
    BlobStorage,
    HashingReader,
    PutResult,
    Source,
    file_digest,
    open_source,
    validate_key,
    validate_prefix,
)


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

    @classmethod
    def at(cls, uri: str, *, endpoint_url: str | None = None) -> tuple[S3Storage, str]:
        """The bucket's storage and the key (or prefix, without its trailing '/') that an
        `s3://bucket/key` URI names; InvalidInput names a URI that is not one."""
        parsed = urlparse(uri)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise InvalidInput(f"'{uri}' is not an s3://bucket/key URI.", code="invalid_storage_url")
        return cls(parsed.netloc, endpoint_url=endpoint_url), validate_key(parsed.path.strip("/"))

    def _full(self, key: str) -> str:
        return self.base + key

    def _upload(self, full_key: str, reader: HashingReader, metadata: dict[str, str]) -> None:
        # upload_fileobj aborts a multipart upload that fails, so a failed put leaves nothing.
        self.client.upload_fileobj(reader, self.bucket, full_key, ExtraArgs={"Metadata": metadata})

    def put(self, key: str, source: Source, *, max_bytes: int | None = None) -> PutResult:
        validate_key(key)
        metadata: dict[str, str] = {}
        if isinstance(source, os.PathLike):
            # Hashing the file first lets the object carry its digest, which publish verifies.
            digest, size = file_digest(Path(source))
            if max_bytes is not None and size > max_bytes:
                raise PayloadTooLarge(f"The upload is {size} bytes; the limit is {max_bytes} bytes.")
            metadata["sha256"] = digest
        elif isinstance(source, (bytes, bytearray, memoryview)):
            metadata["sha256"] = hashlib.sha256(source).hexdigest()
        stream = open_source(source)
        try:
            reader = HashingReader(stream, max_bytes)
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
            return cast(BinaryIO, self.client.get_object(Bucket=self.bucket, Key=self._full(validate_key(key)))["Body"])
        except self.client.exceptions.NoSuchKey:
            raise NotFound(f"No stored object '{key}'.", code="storage_object_not_found") from None

    def exists(self, key: str) -> bool:
        return self._head(self._full(validate_key(key))) is not None

    def _head(self, full_key: str) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError

        try:
            return cast(dict[str, Any], self.client.head_object(Bucket=self.bucket, Key=full_key))
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
                digest, size = file_digest(path)
                with path.open("rb") as stream:
                    reader = HashingReader(stream, None)
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
