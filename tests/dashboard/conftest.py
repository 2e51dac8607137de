"""Dashboard suites' fixtures: users with each role in two tenants, and registry rows to act on."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest

PASSWORD = "correct-horse-battery"


@dataclass
class People:
    """alice-co's owner, member and viewer, and bob-co's owner."""

    owner: object
    member: object
    viewer: object
    bob: object


@pytest.fixture
def people(tenant_a, tenant_b) -> People:
    from django.contrib.auth import get_user_model

    from tenants.models import Membership

    users = get_user_model().objects

    def user(name: str, tenant, role: str):
        created = users.create_user(username=name, email=f"{name}@example.com", password=PASSWORD)
        Membership.objects.create(user=created, tenant=tenant.tenant, role=role)
        return created

    return People(owner=user("olivia", tenant_a, "owner"), member=user("mario", tenant_a, "member"),
                  viewer=user("vera", tenant_a, "viewer"), bob=user("bob", tenant_b, "owner"))


@pytest.fixture
def as_user(client) -> Callable[[object], object]:
    """`as_user(user)` → the test client logged in as that user."""

    def login(user) -> object:
        client.force_login(user)
        return client

    return login


@pytest.fixture
def make_version(settings) -> Callable[..., object]:
    """`make(adapter, "1.0.0")` → a ready version row (for registry actions that read no artifact)."""
    from serving.registry.models import AdapterVersion

    def make(adapter, version: str, **fields: object) -> AdapterVersion:
        values = dict(
            artifact_uri=f"file:///nowhere/{adapter.name}/{version}/",
            manifest_sha256=hashlib.sha256(f"{adapter}@{version}".encode()).hexdigest(),
            base_model=settings.BASE_MODEL_NAME, rank=8, lora_alpha=16.0, target_modules=["q_proj", "v_proj"],
            size_bytes=1024, source=AdapterVersion.Source.UPLOAD,
        )
        values.update(fields)
        return AdapterVersion.objects.create(adapter=adapter, version=version, **values)

    return make
