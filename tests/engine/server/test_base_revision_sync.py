"""A worker started on a Hugging Face id (from a hub cache laid out on disk, offline) serves its
snapshot and refuses the registry's versions built on another commit of the base, naming both."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from serving.registry import services
from tests.hub_cache import cache_model

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "revision-test-token"
REPO = "tiny-org/tiny-base"
WORKER_COMMIT = "0123456789abcdef0123456789abcdef01234567"
REGISTRY_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def test_a_version_of_another_base_commit_is_refused(settings, tiny_model: Path, tenant_a, start_worker, make_adapter,
                                                       live_server, tmp_path: Path) -> None:
    settings.BASE_MODEL_PATH = tiny_model
    settings.BASE_MODEL_NAME = REPO
    settings.BASE_MODEL_REVISION = REGISTRY_COMMIT
    settings.BASE_MODEL_ALIASES = [str(tiny_model)]  # what the test adapters name as their base
    settings.MAX_LORA_RANK = 32
    settings.STORAGE_URL = f"file://{tmp_path / 'storage'}"
    settings.REGISTRY_TOKEN = TOKEN
    cache_model(tmp_path / "hf-home" / "hub", REPO, tiny_model, WORKER_COMMIT)

    source = make_adapter(r=8, target_modules=("q_proj", "v_proj"), seed=41)
    adapter = services.adapter_create(tenant=tenant_a.tenant, name="support-bot")
    files = [SimpleUploadedFile(name, (source / name).read_bytes())
             for name in ("adapter_config.json", "adapter_model.safetensors")]
    version = services.adapter_version_upload(adapter=adapter, files=files, actor="test", version="1.0.0")
    services.adapter_version_deploy(version=version, actor="test")

    worker = start_worker(
        "--model", REPO, "--allowed-adapter-path", settings.STORAGE_URL,
        "--registry-url", f"{live_server.url}/api/v1/internal/registry/snapshot", "--registry-token", TOKEN,
        "--registry-reconcile-interval", "60",
        env={"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hf-home" / "hub")},
    )
    deadline = time.monotonic() + 60
    while worker.metric("loraplex_registry_snapshots_total") < 1:
        assert time.monotonic() < deadline, worker.log()
        time.sleep(0.2)
    models = {card["id"] for card in httpx.get(f"{worker.url}/v1/models", timeout=10).json()["data"]}
    assert models == {REPO}  # served under its id; the registry's version is not
    assert (f"registry version alice-co/support-bot@1.0.0 was built on revision {REGISTRY_COMMIT} of base model "
            f"{REPO}, but this worker serves revision {WORKER_COMMIT}") in worker.log()
