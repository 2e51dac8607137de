"""Uploads of tenants' own PEFT adapters, and registration of training artifacts: what is accepted
is loadable by the engine with verified digests; every refusal names its problem and leaves nothing
behind, in storage or in the database."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db.models.signals import pre_save
from safetensors.torch import load_file, save_file
from rest_framework.test import APIClient
from transformers import (
    AutoConfig,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from serving.contracts.errors import InvalidInput, LimitExceeded
from serving.registry import services, uploads
from serving.contracts.artifact import adapter_digest, base_config_sha256, manifest_verify, manifest_write
from serving.engine.lora.reader import BaseShapes, load_adapter
from serving.registry.models import Adapter, AdapterVersion, DeploymentEvent
from tests.registry.conftest import BASE_ALIAS, adapter_files, config_with

pytestmark = pytest.mark.django_db

URL = "/api/v1/adapters/support-bot/versions"


def multipart(files: dict[str, bytes], **data: str) -> dict:
    return {"files": [SimpleUploadedFile(name, content) for name, content in files.items()], **data}


def upload(client, files: dict[str, bytes], **data: str):
    return client.post(URL, multipart(files, **data), format="multipart")


def zipped(entries: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, content in entries.items():
            archive.writestr(zipfile.ZipInfo(name), content, compress_type=compression)
    return buffer.getvalue()


def tarred(entries: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, content in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            archive.addfile(info, io.BytesIO(content))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            archive.addfile(info)
    return buffer.getvalue()


def assert_nothing_left(storage) -> None:
    assert storage.list("") == []
    assert not AdapterVersion.objects.exists()
    assert not DeploymentEvent.objects.exists()


@pytest.fixture
def adapter(adapter_a):
    return adapter_a


def _download(storage, prefix: str, where: Path) -> Path:
    storage.download_prefix(prefix, where)
    return where


# --- accepted ---------------------------------------------------------------------------------


def test_a_dora_adapter_is_registered_as_its_kind(client_a, adapter, make_peft_adapter, storage, tmp_path):
    response = upload(client_a, adapter_files(make_peft_adapter(use_dora=True)), version="1.0.0")
    assert response.status_code == 201, response.json()
    assert response.json()["kind"] == "dora"
    assert AdapterVersion.objects.get().kind == "dora"
    manifest = manifest_verify(_download(storage, "adapters/alice-co/support-bot/1.0.0", tmp_path / "artifact"))
    assert manifest["peft"]["kind"] == "dora"


def test_peft_adapter_upload_is_published_with_a_verifiable_manifest(client_a, tenant_a, adapter, peft_adapter,
                                                                      storage, tmp_path, tiny_base_dir):
    response = upload(client_a, adapter_files(peft_adapter), version="1.0.0", reason="trained on our tickets")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert (body["version"], body["status"], body["rank"], body["lora_alpha"], body["target_modules"]) == (
        "1.0.0", "ready", 8, 16.0, ["q_proj", "v_proj"])
    assert body["model"] == "support-bot@1.0.0" and body["source"] == {"kind": "upload", "id": None}
    assert body["kind"] == "lora"

    prefix = "adapters/alice-co/support-bot/1.0.0"
    assert storage.list(prefix) == [f"{prefix}/adapter_config.json", f"{prefix}/adapter_model.safetensors",
                                    f"{prefix}/manifest.json"]
    local = _download(storage, prefix, tmp_path / "artifact")
    manifest = manifest_verify(local)
    assert manifest["adapter"] == {"tenant": "alice-co", "name": "support-bot", "version": "1.0.0"}
    assert manifest["base_model"] == {"name": "tiny-llama", "config_sha256": base_config_sha256(tiny_base_dir)}
    assert manifest["peft"] == {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "kind": "lora"}
    assert manifest["source"]["kind"] == "upload"
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (local / name).read_bytes() == (peft_adapter / name).read_bytes()

    version = AdapterVersion.objects.get()
    assert version.manifest_sha256 == adapter_digest(local) == body["manifest_sha256"]
    assert version.artifact_uri == storage.uri(prefix) + "/"
    assert version.size_bytes == sum((peft_adapter / name).stat().st_size for name in adapter_files(peft_adapter))
    event = DeploymentEvent.objects.get()
    key_prefix = tenant_a.key.removeprefix("lp-").split(".")[0]
    assert (event.kind, event.to_version, event.actor, event.reason) == (
        "register", "1.0.0", f"api-key:{key_prefix}", "trained on our tickets")

    # The serving engine loads the published artifact straight from its URI, digests verified.
    loaded = load_adapter(version.artifact_uri, base_config=AutoConfig.from_pretrained(tiny_base_dir),
                          max_lora_rank=32)
    assert loaded.digest == version.manifest_sha256 and loaded.rank == 8


@pytest.mark.parametrize("packer", ["zip", "tar.gz"])
def test_archive_uploads_with_files_at_the_root(client_a, adapter, peft_adapter, storage, packer):
    entries = {**adapter_files(peft_adapter), "README.md": b"# model card\n"}
    archive = zipped(entries) if packer == "zip" else tarred({f"./{name}": data for name, data in entries.items()})
    first = upload(client_a, {f"adapter.{packer}": archive})
    assert first.status_code == 201, first.json()
    second = upload(client_a, {f"adapter.{packer}": archive})
    assert (first.json()["version"], second.json()["version"]) == ("1.0.0", "1.0.1")
    assert "adapters/alice-co/support-bot/1.0.1/README.md" not in storage.list("")
    assert len(storage.list("adapters/alice-co/support-bot/1.0.1")) == 3


def test_upload_to_s3_storage(client_a, adapter, peft_adapter, settings, s3_bucket, moto_s3_endpoint,
                              tiny_base_dir):
    settings.STORAGE_URL = f"s3://{s3_bucket}/platform"
    settings.S3_ENDPOINT_URL = moto_s3_endpoint
    from serving.registry.storage import get_storage

    response = upload(client_a, adapter_files(peft_adapter), version="2.0.0")
    assert response.status_code == 201, response.json()
    uri = response.json()["artifact_uri"]
    assert uri == f"s3://{s3_bucket}/platform/adapters/alice-co/support-bot/2.0.0/"
    loaded = load_adapter(uri, base_config=AutoConfig.from_pretrained(tiny_base_dir), max_lora_rank=32)
    assert loaded.digest == response.json()["manifest_sha256"]

    refused = upload(client_a, {"adapter_config.json": adapter_files(peft_adapter)["adapter_config.json"]})
    assert refused.status_code == 400
    assert len(get_storage().list("")) == 3


# --- refused, with nothing left ---------------------------------------------------------------


def _truncated(peft: Path) -> dict[str, bytes]:
    files = adapter_files(peft)
    weights = files["adapter_model.safetensors"]
    return {**files, "adapter_model.safetensors": weights[: len(weights) // 2]}


def _reshaped(peft: Path, tmp_path: Path) -> dict[str, bytes]:
    tensors = load_file(peft / "adapter_model.safetensors")
    name = next(key for key in sorted(tensors) if key.endswith("q_proj.lora_A.weight"))
    tensors[name] = tensors[name][:, :48].contiguous()  # the base's hidden size is 64
    path = tmp_path / "reshaped.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return {**adapter_files(peft), "adapter_model.safetensors": path.read_bytes()}


REFUSALS = {
    "pickled .bin": (lambda peft, tmp: {"adapter_config.json": adapter_files(peft)["adapter_config.json"],
                                        "adapter_model.bin": b"\x80\x04\x95 pickle"}, 400, "pickled PyTorch file"),
    "wrong shapes": (_reshaped, 400, "has shape (8, 48), but the base model with r=8 expects (8, 64)"),
    "unknown module": (lambda peft, tmp: {**adapter_files(peft), "adapter_config.json": config_with(
        peft, target_modules=["q_proj", "classifier"])}, 400, "unsupported target module(s) classifier"),
    "wrong base model": (lambda peft, tmp: {**adapter_files(peft), "adapter_config.json": config_with(
        peft, base_model_name_or_path="meta-llama/Meta-Llama-3-8B")}, 400,
        "trained for base model 'meta-llama/Meta-Llama-3-8B'"),
    "not LoRA": (lambda peft, tmp: {**adapter_files(peft), "adapter_config.json": config_with(
        peft, peft_type="PREFIX_TUNING")}, 400, "only LoRA adapters"),
    "config not JSON": (lambda peft, tmp: {**adapter_files(peft), "adapter_config.json": b"{r: 8"}, 400,
                        "adapter_config.json is not valid JSON"),
    "truncated safetensors": (lambda peft, tmp: _truncated(peft), 400, "not a valid safetensors file"),
    "zip path traversal": (lambda peft, tmp: {"evil.zip": zipped({
        "../adapter_config.json": adapter_files(peft)["adapter_config.json"],
        "adapter_model.safetensors": adapter_files(peft)["adapter_model.safetensors"]})}, 400,
        "points outside the archive"),
    "tar absolute path": (lambda peft, tmp: {"evil.tar.gz": tarred({"/tmp/adapter_config.json": b"{}"})}, 400,
                          "absolute or Windows path"),
    "tar symlink": (lambda peft, tmp: {"evil.tar.gz": tarred(
        {"adapter_config.json": adapter_files(peft)["adapter_config.json"]},
        links={"adapter_model.safetensors": "/etc/passwd"})}, 400, "link or special file"),
    "zip with a folder": (lambda peft, tmp: {"a.zip": zipped({f"my-adapter/{name}": data for name, data in
                                                                adapter_files(peft).items()})}, 400,
                          "in a subdirectory"),
    "not a zip": (lambda peft, tmp: {"a.zip": b"PK but not really"}, 400, "not a valid zip archive"),
    "missing weights": (lambda peft, tmp: {"adapter_config.json": adapter_files(peft)["adapter_config.json"]},
                        400, "lacks adapter_model.safetensors"),
    "unexpected file": (lambda peft, tmp: {**adapter_files(peft), "notes.txt": b"hi"}, 400,
                        "Unexpected file 'notes.txt'"),
    "own manifest": (lambda peft, tmp: {**adapter_files(peft), "manifest.json": b"{}"}, 400,
                     "Unexpected file 'manifest.json'"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_uploads_leave_nothing(client_a, adapter, peft_adapter, storage, tmp_path, case):
    build, status, message = REFUSALS[case]
    response = upload(client_a, build(peft_adapter, tmp_path))
    assert response.status_code == status, response.json()
    error = response.json()["error"]
    assert message in error["message"], error["message"]
    assert str(tmp_path) not in error["message"] and "loraplex-upload-" not in error["message"]
    assert_nothing_left(storage)


def test_rank_above_the_platform_maximum_is_refused(client_a, adapter, make_peft_adapter, storage):
    response = upload(client_a, adapter_files(make_peft_adapter(r=48)))
    assert response.status_code == 400
    assert "adapter rank 48 exceeds max_lora_rank 32" in response.json()["error"]["message"]
    assert_nothing_left(storage)


def test_alias_of_the_base_model_is_accepted(client_a, adapter, make_peft_adapter):
    response = upload(client_a, adapter_files(make_peft_adapter(base_name=BASE_ALIAS)))
    assert response.status_code == 201, response.json()
    assert response.json()["base_model"] == "tiny-llama"


def test_size_limit(client_a, adapter, peft_adapter, storage, settings):
    settings.ADAPTER_MAX_BYTES = 2000
    response = upload(client_a, adapter_files(peft_adapter))
    assert response.status_code == 413
    assert "exceed the limit of 2000 bytes" in response.json()["error"]["message"]
    zip_bomb = zipped({"adapter_model.safetensors": b"\0" * 100_000}, zipfile.ZIP_DEFLATED)
    assert len(zip_bomb) < 2000
    assert upload(client_a, {"a.zip": zip_bomb}).status_code == 413
    assert_nothing_left(storage)


def test_bad_requests(client_a, adapter, peft_adapter, storage):
    assert upload(client_a, {}).json()["error"]["code"] == "no_files"
    bad_version = upload(client_a, adapter_files(peft_adapter), version="v1")
    assert bad_version.status_code == 400 and "not a semantic version" in bad_version.json()["error"]["message"]
    as_json = client_a.post(URL, {"files": []}, format="json")
    assert as_json.status_code == 400 and as_json.json()["error"]["code"] == "multipart_required"
    assert_nothing_left(storage)


def test_duplicate_version_is_refused_and_the_first_artifact_survives(client_a, adapter, peft_adapter, storage):
    assert upload(client_a, adapter_files(peft_adapter), version="1.0.0").status_code == 201
    before = {key: storage.get_bytes(key) for key in storage.list("")}
    response = upload(client_a, adapter_files(peft_adapter), version="1.0.0")
    assert response.status_code == 409 and "already has a version 1.0.0" in response.json()["error"]["message"]
    assert {key: storage.get_bytes(key) for key in storage.list("")} == before
    assert AdapterVersion.objects.count() == 1


def test_a_failure_after_publishing_removes_the_artifact(adapter, peft_adapter, storage):
    def refuse(sender, **kwargs):
        raise RuntimeError("the database went away")

    pre_save.connect(refuse, sender=DeploymentEvent)
    try:
        files = [SimpleUploadedFile(name, data) for name, data in adapter_files(peft_adapter).items()]
        with pytest.raises(RuntimeError, match="went away"):
            services.adapter_version_upload(adapter=adapter, files=files, actor="api-key:test")
    finally:
        pre_save.disconnect(refuse, sender=DeploymentEvent)
    assert_nothing_left(storage)


# --- training artifacts: adapter_version_register ---------------------------------------------


def publish_training_artifact(storage, source: Path, tmp_path: Path, *, tenant: str = "alice-co",
                              name: str = "support-bot", version: str = "1.0.0", job: str = "42",
                              config_sha256: str | None = None) -> str:
    """What a training job does before registering: write the manifest, publish the directory."""
    from django.conf import settings

    local = tmp_path / f"train-{name}-{version}"
    local.mkdir()
    for file_name, data in adapter_files(source).items():
        (local / file_name).write_bytes(data)
    manifest_write(local, tenant=tenant, name=name, version=version, base_model_name="tiny-llama",
                   base_config_sha256=config_sha256 or base_config_sha256(settings.BASE_MODEL_PATH),
                   source_kind="training_job",
                   source_id=job)
    prefix = f"adapters/{tenant}/{name}/{version}"
    storage.publish_directory(local, prefix)
    return prefix


def test_register_training_artifact(tenant_a, peft_adapter, storage, tmp_path):
    prefix = publish_training_artifact(storage, peft_adapter, tmp_path)
    version = services.adapter_version_register(tenant=tenant_a.tenant, adapter_name="support-bot", version="1.0.0",
                                                artifact_prefix=prefix, training_job_id="42")
    assert (version.status, version.source, version.source_id, version.rank) == ("ready", "training_job", "42", 8)
    assert Adapter.objects.get().name == "support-bot"
    event = DeploymentEvent.objects.get()
    assert (event.kind, event.actor, event.to_version) == ("register", "training-job:42", "1.0.0")
    # A redelivered task registers the same artifact again: same row, no second event.
    again = services.adapter_version_register(tenant=tenant_a.tenant, adapter_name="support-bot", version="1.0.0",
                                              artifact_prefix=prefix, training_job_id="42")
    assert again.pk == version.pk and DeploymentEvent.objects.count() == 1
    with pytest.raises(InvalidInput, match="records source training_job '42', not training_job '43'"):
        services.adapter_version_register(tenant=tenant_a.tenant, adapter_name="support-bot", version="1.0.0",
                                          artifact_prefix=prefix, training_job_id="43")
    assert DeploymentEvent.objects.count() == 1


def test_register_refuses_bad_artifacts_and_writes_nothing(tenant_a, peft_adapter, storage, tmp_path):
    prefix = publish_training_artifact(storage, peft_adapter, tmp_path, version="1.0.0")
    with pytest.raises(InvalidInput, match="names .*'version': '1.0.0'.*not .*'version': '1.0.1'"):
        services.adapter_version_register(tenant=tenant_a.tenant, adapter_name="support-bot", version="1.0.1",
                                          artifact_prefix=prefix, training_job_id="42")
    with pytest.raises(InvalidInput, match="No artifact is published"):
        services.adapter_version_register(tenant=tenant_a.tenant, adapter_name="support-bot", version="1.0.0",
                                          artifact_prefix="adapters/alice-co/support-bot/9.9.9", training_job_id="42")
    other_base = publish_training_artifact(storage, peft_adapter, tmp_path, version="1.1.0", config_sha256="0" * 64)
    with pytest.raises(InvalidInput, match="base model whose config differs"):
        services.adapter_version_register(tenant=tenant_a.tenant, adapter_name="support-bot", version="1.1.0",
                                          artifact_prefix=other_base, training_job_id="42")
    storage.put(f"{prefix}/adapter_model.safetensors", b"tampered")
    with pytest.raises(InvalidInput, match="fails verification"):
        services.adapter_version_register(tenant=tenant_a.tenant, adapter_name="support-bot", version="1.0.0",
                                          artifact_prefix=prefix, training_job_id="42")
    assert not Adapter.objects.exists() and not DeploymentEvent.objects.exists()


def test_register_respects_the_tier_adapter_limit(tenant_a, peft_adapter, storage, tmp_path):
    tier = tenant_a.tenant.tier
    tier.max_adapters = 0
    tier.save()
    prefix = publish_training_artifact(storage, peft_adapter, tmp_path)
    with pytest.raises(LimitExceeded):
        services.adapter_version_register(tenant=tenant_a.tenant, adapter_name="support-bot", version="1.0.0",
                                          artifact_prefix=prefix, training_job_id="42")
    assert not Adapter.objects.exists()


def test_snapshot_entry_of_an_uploaded_version_points_at_a_loadable_artifact(client_a, adapter,
                                                                              peft_adapter, tiny_base_dir, settings):
    settings.REGISTRY_TOKEN = "worker-secret"
    assert upload(client_a, adapter_files(peft_adapter), version="1.0.0").status_code == 201
    assert client_a.post("/api/v1/adapters/support-bot/versions/1.0.0/deploy", {}, format="json").status_code == 200
    worker = APIClient()
    snapshot = worker.get("/api/v1/internal/registry/snapshot", HTTP_AUTHORIZATION="Bearer worker-secret").json()
    (entry,) = snapshot["adapters"]
    loaded = load_adapter(entry["artifact_uri"], base_config=AutoConfig.from_pretrained(tiny_base_dir),
                          max_lora_rank=32)
    assert loaded.digest == entry["manifest_sha256"]
    assert json.loads(json.dumps(entry))["name"] == "alice-co/support-bot@1.0.0"


# --- hostile archives and configs (docs/security.md) --------------------------------------------------


def gzipped_tar_stream(headers_and_data: list[tuple[tarfile.TarInfo, bytes]], tail: bytes = b"") -> bytes:
    """A .tar.gz written by hand: each header with the data given (which may be shorter than the
    header says), then `tail` raw bytes; nothing after is valid, so only a streaming reader that
    stops in time gives a clean answer."""
    import gzip

    body = b"".join(info.tobuf(format=tarfile.GNU_FORMAT) + data for info, data in headers_and_data)
    return gzip.compress(body) + tail


def test_a_tar_gz_with_too_many_entries_is_refused_at_the_first_entry_over_the_budget(client_a, adapter, storage):
    empty = [(tarfile.TarInfo("README.md"), b"")] * 100
    # After the 100 entries the archive is garbage: listing it whole (the old getmembers) fails there.
    archive = gzipped_tar_stream(empty, tail=b"\x00garbage, not gzip")
    response = upload(client_a, {"many.tar.gz": archive})
    assert response.status_code == 400, response.json()
    error = response.json()["error"]
    assert error["code"] == "too_many_archive_entries" and "more than 64 entries" in error["message"]
    assert_nothing_left(storage)


def test_a_tar_gz_entry_declaring_more_than_the_budget_is_refused_before_its_bytes(client_a, adapter, storage,
                                                                                  settings):
    settings.ADAPTER_MAX_BYTES = 10 * 1024 * 1024
    huge = tarfile.TarInfo("adapter_model.safetensors")
    huge.size = 4 * 1024 ** 3  # 4 GiB of zeros declared; a few KB actually follow
    archive = gzipped_tar_stream([(huge, b"\0" * 4096)])
    assert len(archive) < 10_000
    response = upload(client_a, {"bomb.tar.gz": archive})
    assert response.status_code == 413, response.json()
    message = response.json()["error"]["message"]
    assert "exceed the limit of 10485760 bytes" in message and "at entry 'adapter_model.safetensors'" in message
    assert_nothing_left(storage)


def test_skipped_entries_count_against_the_byte_budget_too(client_a, adapter, storage, settings):
    settings.ADAPTER_MAX_BYTES = 2000
    skipped = tarfile.TarInfo("__MACOSX/._adapter_model.safetensors")
    skipped.size = 5000
    response = upload(client_a, {"a.tar.gz": gzipped_tar_stream([(skipped, b"\0" * 5120)])})
    assert response.status_code == 413 and response.json()["error"]["code"] == "adapter_too_large"
    assert_nothing_left(storage)


def test_a_zip_with_too_many_entries_is_refused(client_a, adapter, storage):
    response = upload(client_a, {"many.zip": zipped({f"__MACOSX/{index}": b"" for index in range(65)})})
    assert response.status_code == 400 and response.json()["error"]["code"] == "too_many_archive_entries"
    assert_nothing_left(storage)


@pytest.mark.parametrize("packer", ["files", "tar.gz"])
@pytest.mark.parametrize(("config", "code", "message"), [
    (b"[" * 30_000 + b"]" * 30_000, "config_too_deep", "'adapter_config.json' is nested deeper than 16 levels"),
    (json.dumps({"r": 8, "a": "[" * 17 + "1" + "]" * 17}).replace('"[', "[").replace(']"', "]").encode(),
     "config_too_deep", "deeper than 16 levels"),
    (b'{"r": 8, "pad": "' + b"x" * 70_000 + b'"}', "config_too_large", "'adapter_config.json' is 70019 bytes"),
])
def test_a_hostile_adapter_config_is_a_400_naming_the_file(client_a, adapter, peft_adapter, storage, packer, config,
                                                          code, message):
    files = {**adapter_files(peft_adapter), "adapter_config.json": config}
    response = upload(client_a, files if packer == "files" else {"a.tar.gz": tarred(files)})
    assert response.status_code == 400, response.content[:500]
    error = response.json()["error"]
    assert error["code"] == code and message in error["message"], error
    assert_nothing_left(storage)


# --- the base model the upload is checked against ---------------------------------------------


@pytest.mark.parametrize("config_class,fields", [
    (LlamaConfig, {}),
    (LlamaConfig, {"num_key_value_heads": 2, "head_dim": 24}),  # grouped KV heads, head_dim not hidden/heads
    (Qwen2Config, {"num_key_value_heads": 2}),
    (Qwen3Config, {"num_key_value_heads": 2}),  # head_dim 128 by default, whatever hidden/heads is
    (MistralConfig, {"num_key_value_heads": 1}),
    (Phi3Config, {}),  # fused qkv_proj and gate_up_proj, as Phi-3's adapters name them
    (Gemma2Config, {"num_key_value_heads": 2}),  # head_dim 256 by default
    (Gemma3TextConfig, {"num_key_value_heads": 1, "head_dim": 32}),
], ids=["llama", "llama-gqa-head-dim", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3"])
def test_the_upload_check_reads_the_shapes_the_engine_reads(tmp_path, config_class, fields):
    """The web process reads config.json itself (no transformers in it); the engine reads it through
    AutoConfig: both must see the same layers and module shapes, or an accepted adapter fails to load."""
    config_class(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                 **fields).save_pretrained(tmp_path)
    assert uploads._base_shapes(tmp_path) == BaseShapes.from_config(AutoConfig.from_pretrained(tmp_path))


def test_a_missing_or_unreadable_base_model_is_a_503_naming_it(client_a, adapter, peft_adapter, storage, settings,
                                                              tmp_path):
    settings.BASE_MODEL_PATH = tmp_path
    missing = upload(client_a, adapter_files(peft_adapter))
    assert missing.status_code == 503 and missing.json()["error"]["code"] == "base_model_unavailable"
    assert f"not available at {tmp_path}" in missing.json()["error"]["message"]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    unreadable = upload(client_a, adapter_files(peft_adapter))
    assert unreadable.status_code == 503 and unreadable.json()["error"]["code"] == "base_model_unavailable"
    assert "config.json" in unreadable.json()["error"]["message"]
    assert_nothing_left(storage)
