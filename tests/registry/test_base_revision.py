"""The base model's revision on adapter versions: recorded when a version is registered, and a
version built on another commit than the platform serves is refused for serving, naming both."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from serving.registry import services
from serving.registry.models import AdapterVersion
from serving.contracts.errors import Conflict

pytestmark = pytest.mark.django_db

SERVED = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def test_an_upload_records_the_platform_base_revision(settings, adapter_a, peft_adapter: Path) -> None:
    settings.BASE_MODEL_REVISION = SERVED
    files = [SimpleUploadedFile(name, (peft_adapter / name).read_bytes())
             for name in ("adapter_config.json", "adapter_model.safetensors")]
    version = services.adapter_version_upload(adapter=adapter_a, files=files, actor="test", version="1.0.0")
    assert AdapterVersion.objects.get(pk=version.pk).base_model_revision == SERVED


def test_a_version_of_another_base_revision_is_not_served(settings, adapter_a, make_version) -> None:
    settings.BASE_MODEL_REVISION = SERVED
    stale = make_version(adapter_a, "1.0.0", base_model_revision=OTHER)
    with pytest.raises(Conflict) as error:
        services.adapter_version_deploy(version=stale, actor="test")
    assert error.value.code == "base_model_revision_mismatch"
    assert OTHER in error.value.message and SERVED in error.value.message
    assert AdapterVersion.objects.get(pk=stale.pk).status == AdapterVersion.Status.READY


@pytest.mark.parametrize(("recorded", "served"), [(SERVED, SERVED), ("", SERVED), (OTHER, "")])
def test_matching_or_unknown_revisions_serve(settings, adapter_a, make_version, recorded: str, served: str) -> None:
    settings.BASE_MODEL_REVISION = served
    version = make_version(adapter_a, "1.0.0", base_model_revision=recorded)
    services.adapter_version_deploy(version=version, actor="test")
    assert AdapterVersion.objects.get(pk=version.pk).status == AdapterVersion.Status.ACTIVE
