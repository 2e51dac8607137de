"""The tenant guide's OpenAI SDK samples (docs/tenants/api.md) run as written against a real web
process and serving worker, with only `base_url` pointed at this test's web process and
LORAPLEX_API_KEY set: the chat, raw-headers, streaming, completions and error samples, in order, in
one namespace as a reader would paste them. The tools and structured-output samples' results depend
on what the model writes (this suite's random tiny model can run into `max_tokens` inside a string),
so they are only compiled (tests/test_docs_site.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from serving.registry import services
from tests.gateway.conftest import upload_version, wait_for_worker

pytestmark = pytest.mark.django_db(transaction=True)

API_GUIDE = Path(__file__).resolve().parents[2] / "docs" / "tenants" / "api.md"
GUIDE_BASE_URL = "http://127.0.0.1:8000/v1"


@pytest.fixture
def deployed(registry, tenant_a, adapter_dirs, worker, redis_client):
    adapter = services.adapter_create(tenant=tenant_a.tenant, name="support-bot")
    version = upload_version(adapter, adapter_dirs[0], "1.0.0")
    services.adapter_version_deploy(version=version, actor="test")
    wait_for_worker(redis_client, "gw-worker-1")
    return version


def test_the_api_guides_samples_run_as_written(web, worker, tenant_a, deployed, monkeypatch, capsys):
    samples = re.findall(r"```python\n(.*?)```", API_GUIDE.read_text(), re.S)
    runnable = [sample for sample in samples if "tools=" not in sample and "response_format=" not in sample]
    assert len(runnable) == 5 and all(GUIDE_BASE_URL in sample for sample in runnable[:1])
    monkeypatch.setenv("LORAPLEX_API_KEY", tenant_a.key)
    namespace: dict[str, object] = {}
    for number, sample in enumerate(runnable):
        exec(compile(sample.replace(GUIDE_BASE_URL, f"{web.url}/v1"), f"api.md sample {number}", "exec"), namespace)
    printed = capsys.readouterr().out.splitlines()
    assert "1.0.0" in printed  # the version that answered, from x-loraplex-adapter-version
    assert any(line.startswith("404 model_not_found ") for line in printed), printed
    assert any(line.strip().endswith(" tokens") for line in printed), printed  # the stream's usage
