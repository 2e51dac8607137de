"""The artifact contract: manifest.json of a PEFT adapter, verified file by file; digests."""

from __future__ import annotations

import hashlib
import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

import pytest

from serving.contracts.artifact import (
    MANIFEST_NAME,
    AdapterError,
    adapter_digest,
    base_config_sha256,
    manifest_build,
    manifest_verify,
    manifest_write,
    sha256_file,
)

WHEN = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


@pytest.fixture(scope="module")
def peft_adapter(tiny_llama_dir, make_adapter) -> Path:
    return make_adapter(tiny_llama_dir, r=4, lora_alpha=8, target_modules=["v_proj", "q_proj"])


@pytest.fixture
def artifact(peft_adapter, tiny_llama_dir, tmp_path) -> Path:
    """A copy of the adapter with its manifest written, free for the test to damage."""
    directory = Path(shutil.copytree(peft_adapter, tmp_path / "artifact"))
    manifest_write(directory, **_fields(tiny_llama_dir))
    return directory


def _fields(base_dir: Path) -> dict:
    return {
        "tenant": "alice-co",
        "name": "support-bot",
        "version": "1.0.0",
        "base_model_name": "tiny-llama",
        "base_config_sha256": base_config_sha256(base_dir),
        "source_kind": "training_job",
        "source_id": 42,
        "created_at": WHEN,
    }


def test_manifest_records_identity_peft_settings_and_every_file(artifact, tiny_llama_dir):
    manifest = json.loads((artifact / MANIFEST_NAME).read_text())

    assert manifest == {
        "format": 1,
        "adapter": {"tenant": "alice-co", "name": "support-bot", "version": "1.0.0"},
        "base_model": {"name": "tiny-llama", "config_sha256": base_config_sha256(tiny_llama_dir)},
        "peft": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "kind": "lora"},
        "files": {
            path.name: {"sha256": sha256_file(path), "bytes": path.stat().st_size}
            for path in sorted(artifact.iterdir())
            if path.name != MANIFEST_NAME
        },
        "source": {"kind": "training_job", "id": "42"},
        "created_at": "2026-11-30T12:00:00+00:00",
    }
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(manifest["files"])
    assert manifest_verify(artifact) == manifest
    assert sorted(p.name for p in artifact.iterdir() if p.name.startswith(".")) == []


def test_sha256_file_matches_hashlib(artifact):
    path = artifact / "adapter_model.safetensors"
    assert sha256_file(path) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_digest_is_the_manifest_sha256_and_follows_any_change(artifact, tiny_llama_dir):
    digest = adapter_digest(artifact)
    assert digest == hashlib.sha256((artifact / MANIFEST_NAME).read_bytes()).hexdigest()

    manifest_write(artifact, **{**_fields(tiny_llama_dir), "version": "1.0.1"})
    assert adapter_digest(artifact) != digest


def test_digest_without_manifest_is_sha256sum_of_the_sorted_files(peft_adapter, tmp_path):
    directory = Path(shutil.copytree(peft_adapter, tmp_path / "plain"))
    listing = "".join(
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
        for p in sorted(directory.iterdir())
    )
    digest = adapter_digest(directory)
    assert digest == hashlib.sha256(listing.encode()).hexdigest()

    weights = directory / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert adapter_digest(directory) != digest


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: _flip_last_byte(d / "adapter_model.safetensors"),
         r"sha256 mismatch for adapter_model\.safetensors"),
        (lambda d: (d / "adapter_model.safetensors").write_bytes(
            (d / "adapter_model.safetensors").read_bytes()[:-10]),
         r"adapter_model\.safetensors .* has \d+ bytes but manifest\.json records \d+"),
        (lambda d: (d / "adapter_config.json").unlink(),
         r"adapter_config\.json is listed in manifest\.json but missing"),
        (lambda d: (d / "adapter_model.bin").write_bytes(b"pickle"),
         r"adapter_model\.bin .* not listed in manifest\.json"),
        (lambda d: (d / MANIFEST_NAME).unlink(), r"manifest\.json is missing"),
        (lambda d: (d / MANIFEST_NAME).write_text("{not json"),
         r"manifest\.json .* not valid JSON"),
        (lambda d: _edit_manifest(d, format=2), r"format 2; this version reads format 1"),
        (lambda d: _edit_manifest(d, files=[]), r"no 'files' object"),
        (lambda d: _edit_manifest(d, files={"../x": {"sha256": "0", "bytes": 1}}),
         r"invalid file name '\.\./x'"),
        (lambda d: (d / "nested").mkdir(), r"nested .* is a directory"),
        (lambda d: (d / "link").symlink_to("/etc/passwd"), r"link .* is a symlink"),
    ],
    ids=["changed", "truncated", "missing", "unlisted", "no-manifest", "bad-json", "format",
         "no-files", "traversal", "subdirectory", "symlink"],
)
def test_verify_names_the_file_and_the_problem(artifact, damage, message):
    damage(artifact)
    with pytest.raises(AdapterError, match=message):
        manifest_verify(artifact)


def _edit_manifest(directory: Path, **changes) -> None:
    path = directory / MANIFEST_NAME
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"source_kind": "import"}, "source kind must be one of training_job, upload"),
        ({"tenant": ""}, "tenant must be a non-empty string"),
    ],
)
def test_build_refuses_bad_fields(peft_adapter, tiny_llama_dir, change, message):
    with pytest.raises(AdapterError, match=message):
        manifest_build(peft_adapter, **{**_fields(tiny_llama_dir), **change})


def test_build_refuses_a_directory_without_adapter_config(tmp_path, tiny_llama_dir):
    (tmp_path / "adapter_model.safetensors").write_bytes(b"x")
    with pytest.raises(AdapterError, match=r"adapter_config\.json is missing"):
        manifest_write(tmp_path, **_fields(tiny_llama_dir))
    assert [p.name for p in tmp_path.iterdir()] == ["adapter_model.safetensors"]


def test_base_config_digest_ignores_volatile_keys_but_not_shapes(tiny_model_factory, tmp_path):
    llama = tiny_model_factory("llama")
    copy = Path(shutil.copytree(llama, tmp_path / "copy"))
    config = json.loads((copy / "config.json").read_text())
    config.update(transformers_version="9.9.9", dtype="bfloat16", _name_or_path="/elsewhere")
    (copy / "config.json").write_text(json.dumps(config, indent=4))

    assert base_config_sha256(copy) == base_config_sha256(llama)
    assert base_config_sha256(tiny_model_factory("qwen2")) != base_config_sha256(llama)
    config["hidden_size"] = 128
    (copy / "config.json").write_text(json.dumps(config))
    assert base_config_sha256(copy) != base_config_sha256(llama)


def test_base_config_digest_of_a_non_model_directory_is_refused(tmp_path):
    with pytest.raises(AdapterError, match=r"config\.json is missing"):
        base_config_sha256(tmp_path)


def test_artifact_json_limits_count_nesting_outside_strings_only(tmp_path):
    from serving.contracts.artifact import MAX_JSON_DEPTH, read_artifact_json

    path = tmp_path / "adapter_config.json"
    # Brackets and escaped quotes inside strings are text, not nesting.
    tricky = {"a": "[[[{{{\\\"[[[" * 100, "b": "\\", "c": [[["deep enough"]]], "d": '"]]]}}}"'}
    path.write_text(json.dumps(tricky))
    assert read_artifact_json(path) == tricky

    path.write_text("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)
    assert read_artifact_json(path) is not None
    path.write_text("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))
    with pytest.raises(AdapterError, match=r"adapter_config\.json in .* is nested deeper than the 32 levels"):
        read_artifact_json(path)

    path.write_text(json.dumps({"pad": "x" * 100}))
    with pytest.raises(AdapterError, match=r"adapter_config\.json in .* is larger than the 64 bytes"):
        read_artifact_json(path, max_bytes=64)
    with pytest.raises(AdapterError, match="not valid JSON"):
        path.write_text('{"r": 8')
        read_artifact_json(path)
