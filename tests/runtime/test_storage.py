"""The blob storage (runtime.storage, runtime.s3): one suite, two backends, a local directory
and S3 over HTTP on the moto server."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import boto3
import pytest

from serving.contracts.errors import Conflict, InvalidInput, NotFound, PayloadTooLarge
from runtime.s3 import S3Storage
from runtime.storage import STAGING_SEGMENT, LocalStorage, PutResult


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path):
    if request.param == "local":
        return LocalStorage(tmp_path / "blobs")
    bucket = request.getfixturevalue("s3_bucket")
    return S3Storage(bucket, "base", endpoint_url=request.getfixturevalue("moto_s3_endpoint"))


def everything_written(storage) -> list[str]:
    """Every object the backend holds under its root, staging area included (which `list` hides)."""
    if isinstance(storage, LocalStorage):
        return sorted(p.relative_to(storage.root).as_posix() for p in storage.root.rglob("*") if p.is_file())
    return sorted(key[len(storage.base):] for key in storage._list_full(""))


class ShortReads(io.RawIOBase):
    """A non-seekable stream whose reads return at most `step` bytes, as a network body's do."""

    def __init__(self, data: bytes, step: int = 7) -> None:
        self._data = io.BytesIO(data)
        self._step = step

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        chunk = self._data.read(min(len(buffer), self._step))
        buffer[:len(chunk)] = chunk
        return len(chunk)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_put_bytes_stream_and_path_round_trip(storage, tmp_path: Path) -> None:
    payload = os.urandom(50_000)
    source_file = tmp_path / "source.bin"
    source_file.write_bytes(payload)

    results = [
        storage.put("datasets/t/a.bin", payload),
        storage.put("datasets/t/b.bin", ShortReads(payload)),
        storage.put("datasets/t/c.bin", source_file),
    ]

    assert results == [PutResult(key, sha(payload), len(payload)) for key in
                       ("datasets/t/a.bin", "datasets/t/b.bin", "datasets/t/c.bin")]
    for result in results:
        assert storage.exists(result.key)
        assert storage.get_bytes(result.key) == payload
        with storage.open(result.key) as stream:
            assert stream.read(10) == payload[:10]


def test_put_replaces_an_existing_object(storage) -> None:
    storage.put("k/v.txt", b"first")
    storage.put("k/v.txt", b"second")
    assert storage.get_bytes("k/v.txt") == b"second"
    assert storage.list("k") == ["k/v.txt"]


@pytest.mark.parametrize("make_source", [lambda data: data, ShortReads], ids=["bytes", "stream"])
def test_put_over_max_bytes_leaves_nothing_and_keeps_the_old_object(storage, make_source) -> None:
    storage.put("d/old.jsonl", b"kept")
    with pytest.raises(PayloadTooLarge, match="limit of 100 bytes"):
        storage.put("d/new.jsonl", make_source(b"x" * 101), max_bytes=100)
    with pytest.raises(PayloadTooLarge):
        storage.put("d/old.jsonl", make_source(b"x" * 101), max_bytes=100)

    assert storage.get_bytes("d/old.jsonl") == b"kept"
    assert everything_written(storage) == ["d/old.jsonl"]
    assert storage.put("d/new.jsonl", b"x" * 100, max_bytes=100).size == 100


def test_stream_over_max_bytes_in_a_multipart_upload_leaves_no_parts(storage) -> None:
    size = 9 * 1024 * 1024  # above boto3's 8 MiB multipart threshold
    with pytest.raises(PayloadTooLarge):
        storage.put("big/blob", ShortReads(b"\0" * size, step=65536), max_bytes=size - 1)
    assert not storage.exists("big/blob")
    assert everything_written(storage) == []
    if isinstance(storage, S3Storage):
        uploads = storage.client.list_multipart_uploads(Bucket=storage.bucket).get("Uploads", [])
        assert uploads == []


@pytest.mark.parametrize("key", ["", "/abs/key", "a/../b", "a//b", "./a", "a/", "a\\b",
                                 f"{STAGING_SEGMENT}/x"])
def test_unsafe_keys_are_refused(storage, key: str) -> None:
    with pytest.raises(InvalidInput, match="key"):
        storage.put(key, b"data")
    with pytest.raises(InvalidInput):
        storage.exists(key)
    assert everything_written(storage) == []


def test_missing_objects(storage, tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="no/such"):
        storage.open("no/such")
    with pytest.raises(NotFound):
        storage.get_bytes("no/such")
    with pytest.raises(NotFound):
        storage.download_prefix("no", tmp_path / "out")
    assert not storage.exists("no/such")
    storage.delete("no/such")  # idempotent
    assert storage.delete_prefix("no") == 0


def test_prefixes_are_directories(storage) -> None:
    for key in ["a/b/1", "a/b/2/3", "a/bc/4", "z"]:
        storage.put(key, key.encode())

    assert storage.list("") == ["a/b/1", "a/b/2/3", "a/bc/4", "z"]
    assert storage.list("a/b") == ["a/b/1", "a/b/2/3"]
    assert storage.list("a/b/") == ["a/b/1", "a/b/2/3"]
    assert storage.list("a/x") == []
    assert storage.delete_prefix("a/b") == 2
    assert storage.list("") == ["a/bc/4", "z"]
    storage.delete("a/bc/4")
    assert storage.list("") == ["z"]
    with pytest.raises(InvalidInput):
        storage.delete_prefix("")


def test_download_and_download_prefix(storage, tmp_path: Path) -> None:
    storage.put("ckpt/step-1/adapter_model.safetensors", b"weights")
    storage.put("ckpt/step-1/nested/state.json", b"{}")

    assert storage.download("ckpt/step-1/nested/state.json", tmp_path / "x" / "s.json").read_bytes() == b"{}"
    paths = storage.download_prefix("ckpt/step-1", tmp_path / "out")
    assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in paths) == [
        "adapter_model.safetensors", "nested/state.json"]
    assert (tmp_path / "out" / "adapter_model.safetensors").read_bytes() == b"weights"


def test_uri_is_readable_without_the_platform(storage) -> None:
    storage.put("adapters/t/a/1.0.0/adapter_config.json", b'{"r": 8}')
    uri = storage.uri("adapters/t/a/1.0.0/adapter_config.json")
    if uri.startswith("file://"):
        assert Path(uri[len("file://"):]).is_absolute()
        assert Path(uri[len("file://"):]).read_bytes() == b'{"r": 8}'
    else:
        bucket, _, key = uri[len("s3://"):].partition("/")
        client = boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"])
        assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == b'{"r": 8}'


def make_artifact(directory: Path) -> dict[str, bytes]:
    files = {
        "adapter_config.json": b'{"r": 8}',
        "adapter_model.safetensors": os.urandom(4096),
        "extra/readme.txt": b"hello",
        "manifest.json": b'{"format": 1}',
    }
    for name, data in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
    return files


def test_publish_directory(storage, tmp_path: Path) -> None:
    files = make_artifact(tmp_path / "artifact")

    results = storage.publish_directory(tmp_path / "artifact", "adapters/t/a/1.0.0")

    assert results[-1].key == "adapters/t/a/1.0.0/manifest.json"
    assert sorted(results, key=lambda r: r.key) == [
        PutResult(f"adapters/t/a/1.0.0/{name}", sha(data), len(data)) for name, data in sorted(files.items())]
    assert everything_written(storage) == sorted(f"adapters/t/a/1.0.0/{name}" for name in files)
    for name, data in files.items():
        assert storage.get_bytes(f"adapters/t/a/1.0.0/{name}") == data


def test_publish_refuses_an_existing_artifact_and_keeps_it(storage, tmp_path: Path) -> None:
    first = make_artifact(tmp_path / "first")
    make_artifact(tmp_path / "second")
    storage.publish_directory(tmp_path / "first", "adapters/t/a/1.0.0")

    with pytest.raises(Conflict, match="already published"):
        storage.publish_directory(tmp_path / "second", "adapters/t/a/1.0.0")

    assert storage.get_bytes("adapters/t/a/1.0.0/adapter_model.safetensors") == first["adapter_model.safetensors"]
    assert len(everything_written(storage)) == len(first)


def test_publish_replaces_debris_without_a_marker(storage, tmp_path: Path) -> None:
    storage.put("adapters/t/a/2.0.0/stale.bin", b"left by an interrupted publish")
    files = make_artifact(tmp_path / "artifact")

    storage.publish_directory(tmp_path / "artifact", "adapters/t/a/2.0.0")

    assert storage.list("adapters/t/a/2.0.0") == sorted(f"adapters/t/a/2.0.0/{name}" for name in files)


def test_publish_needs_the_marker(storage, tmp_path: Path) -> None:
    (tmp_path / "artifact").mkdir()
    (tmp_path / "artifact" / "adapter_config.json").write_bytes(b"{}")
    with pytest.raises(InvalidInput, match="manifest.json"):
        storage.publish_directory(tmp_path / "artifact", "adapters/t/a/1.0.0")
    with pytest.raises(InvalidInput, match="not a directory"):
        storage.publish_directory(tmp_path / "missing", "adapters/t/a/1.0.0")
    assert everything_written(storage) == []


def test_a_failed_publish_leaves_nothing(storage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_artifact(tmp_path / "artifact")
    failing = tmp_path / "artifact" / "adapter_model.safetensors"
    real_open = Path.open

    def open_or_fail(self: Path, *args, **kwargs):
        if self == failing:
            raise OSError("disk read error")
        return real_open(self, *args, **kwargs)

    # The second file of three fails to read, after the first was written.
    monkeypatch.setattr(Path, "open", open_or_fail)
    with pytest.raises(OSError, match="disk read error"):
        storage.publish_directory(tmp_path / "artifact", "adapters/t/a/1.0.0")
    monkeypatch.undo()

    assert everything_written(storage) == []
    assert not storage.exists("adapters/t/a/1.0.0/manifest.json")


def test_download_prefix_is_all_or_nothing_and_flat_on_request(storage, tmp_path: Path) -> None:
    storage.put("art/1/adapter_config.json", b"{}")
    storage.put("art/1/sub/extra.txt", b"x")
    target = tmp_path / "downloads" / "adapter"

    with pytest.raises(InvalidInput, match=r"art/1/sub/extra\.txt is nested under .*art/1/") as refused:
        storage.download_prefix("art/1", target, flat=True)
    assert refused.value.code == "nested_object"
    assert list(target.parent.iterdir()) == []

    storage.put("art/2/adapter_config.json", b"{}")
    assert storage.download_prefix("art/2", target, flat=True) == [target / "adapter_config.json"]
    with pytest.raises(Conflict, match="exists already") as exists:
        storage.download_prefix("art/1", target)
    assert exists.value.code == "download_target_exists"
    assert [p.name for p in target.parent.iterdir()] == ["adapter"]
    assert [p.name for p in target.iterdir()] == ["adapter_config.json"]


def test_a_failed_download_leaves_no_directory(storage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage.put("art/1/a.json", b"{}")
    storage.put("art/1/b.json", b"{}")
    real_download = type(storage).download

    def download_or_fail(self, key: str, path: Path) -> Path:
        if key.endswith("b.json"):
            raise OSError("disk full")
        return real_download(self, key, path)

    # The second object fails, after the first was written.
    monkeypatch.setattr(type(storage), "download", download_or_fail)
    with pytest.raises(OSError, match="disk full"):
        storage.download_prefix("art/1", tmp_path / "out" / "adapter")
    assert list((tmp_path / "out").iterdir()) == []


def test_s3_storage_at_reads_back_a_uri(s3_bucket: str, moto_s3_endpoint: str) -> None:
    storage = S3Storage(s3_bucket, "base", endpoint_url=moto_s3_endpoint)
    storage.put("adapters/t/a/1.0.0/manifest.json", b"{}")

    again, key = S3Storage.at(storage.uri("adapters/t/a/1.0.0") + "/", endpoint_url=moto_s3_endpoint)

    assert (again.bucket, key) == (s3_bucket, "base/adapters/t/a/1.0.0")
    assert again.list(key) == ["base/adapters/t/a/1.0.0/manifest.json"]
    for uri, problem in [("file:///x/y", "not an s3://bucket/key URI"), ("s3:///key", "not an s3://bucket/key URI"),
                         (f"s3://{s3_bucket}/", "non-empty"), (f"s3://{s3_bucket}/a/../b", "'..' segment")]:
        with pytest.raises(InvalidInput, match=problem):
            S3Storage.at(uri)
