"""The registry file: the deployed state as YAML, for operators to review, keep, and restore.

The shape is the design seed's, with each entry qualified by its tenant:

    adapters:
      - {tenant, name, version, base_model, rank, saved_path, status, traffic_weight}

`saved_path` is the version's artifact URI; `traffic_weight` is the share of the adapter's
traffic the version receives (active: 1 − the canary's weight; canary: its weight; others: 0).

Import restores that state through the registry services, so every change is validated and
audited as usual: missing versions are registered from their artifacts (which must still be in
storage at their canonical place), then each adapter's active version, canary and weight, and
archived versions, are brought to what the file says. All of it happens in one transaction: a
file with any problem changes nothing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from django.db import transaction

from serving.contracts.errors import InvalidInput
from serving.registry.storage import get_storage
from serving.registry import selectors, services
from serving.registry.models import Adapter, AdapterVersion, artifact_prefix
from serving.registry.versions import SemVer, version_parse
from tenants.models import Tenant

Status = AdapterVersion.Status
REQUIRED_KEYS = ("tenant", "name", "version", "saved_path", "status")
OPTIONAL_KEYS = ("base_model", "rank", "traffic_weight")


def registry_export(*, tenant: Tenant | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every version (of one tenant, or all), ordered by tenant, adapter and version."""
    versions = AdapterVersion.objects.select_related("adapter__tenant")
    if tenant is not None:
        versions = versions.filter(adapter__tenant=tenant)
    canaries = {item.adapter_id: item for item in versions if item.status == Status.CANARY}
    ordered = sorted(versions, key=lambda item: (item.adapter.tenant.slug, item.adapter.name, SemVer(item.version)))
    return {"adapters": [
        {
            "tenant": item.adapter.tenant.slug,
            "name": item.adapter.name,
            "version": item.version,
            "base_model": item.base_model,
            "rank": item.rank,
            "saved_path": item.artifact_uri,
            "status": item.status,
            "traffic_weight": selectors.served_weight(item, canaries.get(item.adapter_id)) if item.is_served else 0.0,
        }
        for item in ordered
    ]}


@dataclass(frozen=True)
class _Entry:
    index: int
    tenant: Tenant
    name: str
    version: str
    saved_path: str
    status: str
    rank: int | None
    base_model: str | None
    weight: float | None

    @property
    def label(self) -> str:
        return f"entry {self.index} ({self.tenant.slug}/{self.name}@{self.version})"


def _fail(where: str, message: str) -> InvalidInput:
    return InvalidInput(f"Registry file, {where}: {message}", code="invalid_registry_file")


def _parse(document: Any) -> list[_Entry]:
    if not isinstance(document, dict) or not isinstance(document.get("adapters"), list):
        raise _fail("top level", "expected a mapping with an 'adapters' list.")
    tenants = {tenant.slug: tenant for tenant in Tenant.objects.all()}
    entries = []
    for index, raw in enumerate(document["adapters"], start=1):
        where = f"entry {index}"
        if not isinstance(raw, dict):
            raise _fail(where, "expected a mapping.")
        missing = [key for key in REQUIRED_KEYS if raw.get(key) in (None, "")]
        unknown = sorted(set(raw) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
        if missing or unknown:
            problems = [f"missing {', '.join(missing)}"] if missing else []
            problems += [f"unknown key(s) {', '.join(unknown)}"] if unknown else []
            raise _fail(where, "; ".join(problems) + ".")
        if raw["tenant"] not in tenants:
            raise _fail(where, f"no tenant '{raw['tenant']}'; create it first (manage.py tenants create).")
        if raw["status"] not in Status.values:
            raise _fail(where, f"status '{raw['status']}' is not one of {', '.join(Status.values)}.")
        try:
            version_parse(str(raw["version"]))
        except InvalidInput as error:
            raise _fail(where, error.message) from None
        weight = raw.get("traffic_weight")
        canary_weight = None
        if raw["status"] == Status.CANARY:
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight <= 1:
                raise _fail(where, f"a canary needs a traffic_weight from 0 to 1, got {weight!r}.")
            canary_weight = float(weight)
        entries.append(_Entry(
            index=index, tenant=tenants[raw["tenant"]], name=str(raw["name"]), version=str(raw["version"]),
            saved_path=str(raw["saved_path"]), status=raw["status"], rank=raw.get("rank"),
            base_model=raw.get("base_model"), weight=canary_weight,
        ))
    return entries


def _check_adapter(entries: list[_Entry]) -> tuple[_Entry | None, _Entry | None]:
    label = f"{entries[0].tenant.slug}/{entries[0].name}"
    seen = [entry.version for entry in entries]
    if len(set(seen)) != len(seen):
        raise _fail(label, "a version is listed twice.")
    active = [entry for entry in entries if entry.status == Status.ACTIVE]
    canary = [entry for entry in entries if entry.status == Status.CANARY]
    if len(active) > 1 or len(canary) > 1:
        raise _fail(label, "an adapter has at most one active and one canary version.")
    if canary and not active:
        raise _fail(label, "a canary runs beside an active version; the file lists none.")
    return (active[0] if active else None), (canary[0] if canary else None)


def _ensure_version(entry: _Entry, actor: str, done: list[str]) -> AdapterVersion:
    prefix = artifact_prefix(tenant=entry.tenant.slug, adapter=entry.name, version=entry.version)
    expected_uri = get_storage().uri(prefix) + "/"
    if entry.saved_path.rstrip("/") + "/" != expected_uri:
        raise _fail(entry.label, f"saved_path {entry.saved_path} is not where this platform keeps that version "
                                 f"({expected_uri}).")
    existing = AdapterVersion.objects.filter(adapter__tenant=entry.tenant, adapter__name=entry.name,
                                             version=entry.version).select_related("adapter__tenant").first()
    if existing is None:
        try:
            existing = services.adapter_version_register_published(
                tenant=entry.tenant, adapter_name=entry.name, version=entry.version, artifact_prefix=prefix,
                actor=actor, reason="registry import",
            )
        except InvalidInput as error:
            raise _fail(entry.label, error.message) from None
        done.append(f"registered {existing.qualified_name}")
    if entry.rank is not None and entry.rank != existing.rank:
        raise _fail(entry.label, f"rank {entry.rank} in the file, but the artifact has rank {existing.rank}.")
    if entry.base_model is not None and entry.base_model != existing.base_model:
        raise _fail(entry.label, f"base_model '{entry.base_model}' in the file, but the registry records "
                                 f"'{existing.base_model}'.")
    return existing


def _reconcile(adapter: Adapter, entries: list[_Entry], actor: str, done: list[str]) -> None:
    """Brings one adapter's served state and archived versions to what the file says."""
    want_active, want_canary = _check_adapter(entries)
    active, canary = selectors.adapter_served(adapter=adapter)
    if want_active is None and active is not None:
        raise _fail(str(adapter), f"the registry serves {active.version} but the file lists no active version; "
                                  "there is no way to stop serving without deploying another version.")
    keep_canary = (canary is not None and want_canary is not None and canary.version == want_canary.version
                   and active is not None and want_active is not None and active.version == want_active.version)
    if canary is not None and not keep_canary:
        services.adapter_canary_abort(adapter=adapter, actor=actor, reason="registry import")
        done.append(f"aborted canary {canary.qualified_name}")
    if want_active is not None and (active is None or active.version != want_active.version):
        target = adapter.versions.get(version=want_active.version)
        services.adapter_version_deploy(version=target, actor=actor, reason="registry import")
        done.append(f"deployed {target.qualified_name}")
    if want_canary is not None:
        target = adapter.versions.get(version=want_canary.version)
        if not keep_canary:
            services.adapter_canary_start(version=target, weight=want_canary.weight, actor=actor,
                                          reason="registry import")
            done.append(f"started canary {target.qualified_name} at {want_canary.weight}")
        elif target.traffic_weight != want_canary.weight:
            services.adapter_canary_set_weight(adapter=adapter, weight=want_canary.weight, actor=actor,
                                               reason="registry import")
            done.append(f"set canary {target.qualified_name} to {want_canary.weight}")
    for entry in entries:
        if entry.status == Status.ARCHIVED:
            version = adapter.versions.get(version=entry.version)
            if version.status != Status.ARCHIVED:
                services.adapter_version_archive(version=version, actor=actor, reason="registry import")
                done.append(f"archived {version.qualified_name}")


def registry_import(*, document: Any, actor: str, dry_run: bool = False) -> list[str]:
    """Restores the state a registry file describes; returns what was done (or would be, dry_run).

    One transaction: any problem raises InvalidInput (or the service's own error) and nothing changes.
    """
    entries = _parse(document)
    by_adapter: dict[tuple[int, str], list[_Entry]] = defaultdict(list)
    for entry in entries:
        by_adapter[entry.tenant.pk, entry.name].append(entry)
    done: list[str] = []
    with transaction.atomic():
        for group in by_adapter.values():
            _check_adapter(group)
        for group in by_adapter.values():
            for entry in group:
                _ensure_version(entry, actor, done)
        for group in by_adapter.values():
            adapter = Adapter.objects.select_related("tenant").get(tenant=group[0].tenant, name=group[0].name)
            _reconcile(adapter, group, actor, done)
        if dry_run:
            transaction.set_rollback(True)
    return done
