"""`manage.py registry export|import`: review the deployed state as YAML and restore it."""

from __future__ import annotations

import re
from io import StringIO

import pytest
import yaml
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import CommandError, call_command

from serving.registry import services
from serving.registry.models import Adapter, AdapterVersion, DeploymentEvent
from tests.registry.conftest import adapter_files

pytestmark = pytest.mark.django_db

ACTOR = "api-key:setup"


def run(*args: str) -> str:
    out = StringIO()
    call_command("registry", *args, stdout=out)
    return out.getvalue()


def state() -> dict[str, tuple[str, float | None]]:
    return {item.qualified_name: (item.status, item.traffic_weight)
            for item in AdapterVersion.objects.select_related("adapter__tenant")}


@pytest.fixture
def deployed_registry(adapter_a, peft_adapter):
    """support-bot with real artifacts: 1.0.0 active, 1.1.0 canary at 20 %, 1.2.0 archived."""
    for text in ("1.0.0", "1.1.0", "1.2.0"):
        files = [SimpleUploadedFile(name, data) for name, data in adapter_files(peft_adapter).items()]
        services.adapter_version_upload(adapter=adapter_a, files=files, actor=ACTOR, version=text)
    get = adapter_a.versions.get
    services.adapter_version_deploy(version=get(version="1.0.0"), actor=ACTOR)
    services.adapter_canary_start(version=get(version="1.1.0"), weight=0.2, actor=ACTOR)
    services.adapter_version_archive(version=get(version="1.2.0"), actor=ACTOR)
    return adapter_a


def test_export_in_the_seed_shape(deployed_registry, tenant_b, storage, tmp_path):
    path = tmp_path / "registry.yaml"
    assert "Wrote 3 version(s)" in run("export", str(path))
    text = path.read_text()
    assert text.startswith("# Loraplex adapter registry")
    entries = yaml.safe_load(text)["adapters"]
    assert entries[0] == {
        "tenant": "alice-co", "name": "support-bot", "version": "1.0.0", "base_model": "tiny-llama", "rank": 8,
        "saved_path": storage.uri("adapters/alice-co/support-bot/1.0.0") + "/", "status": "active",
        "traffic_weight": pytest.approx(0.8),
    }
    assert [(e["version"], e["status"], e["traffic_weight"]) for e in entries[1:]] == [
        ("1.1.0", "canary", 0.2), ("1.2.0", "archived", 0.0)]
    assert yaml.safe_load(run("export", "-", "--tenant", "bob-co")) == {"adapters": []}
    with pytest.raises(CommandError, match="No tenant 'nobody'"):
        run("export", "-", "--tenant", "nobody")


def test_import_restores_a_lost_registry_from_artifacts(deployed_registry, tmp_path):
    path = tmp_path / "registry.yaml"
    run("export", str(path))
    before = state()
    Adapter.objects.all().delete()  # the database is lost; storage still holds the artifacts

    output = run("import", str(path))
    assert state() == before
    assert "registered alice-co/support-bot@1.0.0" in output and "started canary alice-co/support-bot@1.1.0 at 0.2" in output
    restored = DeploymentEvent.objects.filter(actor="operator:registry-import")
    assert list(restored.order_by("id").values_list("kind", flat=True)) == [
        "register", "register", "register", "deploy", "canary_start", "archive"]
    assert "nothing to change" in run("import", str(path))


def test_import_reconciles_weights_and_dry_run_changes_nothing(deployed_registry, tmp_path):
    path = tmp_path / "registry.yaml"
    run("export", str(path))
    document = yaml.safe_load(path.read_text())
    document["adapters"][1]["traffic_weight"] = 0.5
    path.write_text(yaml.safe_dump(document))

    events = DeploymentEvent.objects.count()
    dry = run("import", str(path), "--dry-run")
    assert "would have set canary alice-co/support-bot@1.1.0 to 0.5" in dry
    assert deployed_registry.versions.get(version="1.1.0").traffic_weight == 0.2
    assert DeploymentEvent.objects.count() == events

    run("import", str(path))
    assert deployed_registry.versions.get(version="1.1.0").traffic_weight == 0.5


def test_import_promotes_when_the_file_says_so(deployed_registry, tmp_path):
    path = tmp_path / "registry.yaml"
    run("export", str(path))
    document = yaml.safe_load(path.read_text())
    document["adapters"][0]["status"] = "deprecated"
    document["adapters"][1]["status"] = "active"
    path.write_text(yaml.safe_dump(document))
    run("import", str(path))
    assert state() == {"alice-co/support-bot@1.0.0": ("deprecated", None),
                       "alice-co/support-bot@1.1.0": ("active", None),
                       "alice-co/support-bot@1.2.0": ("archived", None)}


def _edit(entries: list[dict], case: str) -> None:
    if case == "missing key":
        del entries[0]["saved_path"]
    elif case == "unknown tenant":
        entries[0]["tenant"] = "nobody"
    elif case == "two actives":
        entries[2]["status"] = "active"
    elif case == "canary without active":
        entries[0]["status"] = "ready"
    elif case == "canary weight":
        entries[1]["traffic_weight"] = 1.5
    elif case == "foreign saved_path":
        entries[0]["saved_path"] = "s3://somewhere-else/adapters/x/"
    elif case == "missing artifact":
        entries.append({**entries[2], "version": "9.0.0", "status": "ready",
                        "saved_path": entries[2]["saved_path"].replace("1.2.0", "9.0.0")})
    elif case == "wrong rank":
        entries[0]["rank"] = 16


ERRORS = {
    "missing key": "entry 1: missing saved_path",
    "unknown tenant": "no tenant 'nobody'",
    "two actives": "at most one active and one canary",
    "canary without active": "a canary runs beside an active version",
    "canary weight": "a canary needs a traffic_weight from 0 to 1, got 1.5",
    "foreign saved_path": "is not where this platform keeps that version",
    "missing artifact": "No artifact is published at 'adapters/alice-co/support-bot/9.0.0/'",
    "wrong rank": "rank 16 in the file, but the artifact has rank 8",
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_files_change_nothing(deployed_registry, tmp_path, case):
    path = tmp_path / "registry.yaml"
    run("export", str(path))
    document = yaml.safe_load(path.read_text())
    document["adapters"][1]["traffic_weight"] = 0.6  # a change that must not happen either
    _edit(document["adapters"], case)
    path.write_text(yaml.safe_dump(document))
    before, events = state(), DeploymentEvent.objects.count()
    with pytest.raises(CommandError, match=re.escape(ERRORS[case])):
        run("import", str(path))
    assert state() == before and DeploymentEvent.objects.count() == events


def test_unreadable_files(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("adapters: [unclosed")
    with pytest.raises(CommandError, match="not valid YAML"):
        run("import", str(path))
    with pytest.raises(CommandError, match="Cannot read"):
        run("import", str(tmp_path / "missing.yaml"))
    path.write_text("just text")
    with pytest.raises(CommandError, match="expected a mapping with an 'adapters' list"):
        run("import", str(path))
