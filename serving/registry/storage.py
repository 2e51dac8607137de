"""The platform's blob storage: settings → one storage instance (the storage itself is runtime's).

`STORAGE_URL` names the backend: `file:///abs/path` or `file://relative/path` (relative to the
project directory, settings.BASE_DIR) and `s3://bucket/prefix` (`S3_ENDPOINT_URL` for MinIO,
credentials from the usual `AWS_*`). The storage classes are Django-free (runtime.storage,
runtime.s3) because the serving worker reads the same artifacts; this module is the Django
side of it. It sits in serving, whose artifacts it mostly holds, and training reaches it here as it
reaches the registry (lora_platform, the project's wiring, is imported by no app).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from django.conf import settings

from serving.contracts.errors import InvalidInput
from runtime.s3 import S3Storage
from runtime.storage import BlobStorage, LocalStorage


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
    return _cached_storage(settings.STORAGE_URL, settings.S3_ENDPOINT_URL, Path(settings.BASE_DIR))
