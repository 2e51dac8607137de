"""The platform's storage wiring (serving.registry.storage): settings → the storage instance."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from serving.registry.storage import get_storage, storage_from_url
from serving.contracts.errors import InvalidInput
from runtime.storage import LocalStorage


def test_get_storage_follows_settings(settings, tmp_path: Path, s3_bucket: str) -> None:
    settings.STORAGE_URL = "file://relative/blobs"
    settings.BASE_DIR = tmp_path
    local = get_storage()
    assert isinstance(local, LocalStorage) and local.root == (tmp_path / "relative" / "blobs").resolve()
    assert local.uri("k") == (tmp_path / "relative" / "blobs" / "k").resolve().as_uri()

    settings.STORAGE_URL = f"s3://{s3_bucket}/pre/fix"
    settings.S3_ENDPOINT_URL = os.environ["S3_ENDPOINT_URL"]
    remote = get_storage()
    remote.put("k", b"v")
    assert remote.uri("k") == f"s3://{s3_bucket}/pre/fix/k"
    assert get_storage() is remote

    with pytest.raises(InvalidInput, match="Unsupported STORAGE_URL"):
        storage_from_url("ftp://host/x")
