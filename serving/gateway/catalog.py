"""The gateway's view of the database: who is calling (API key → tenant → tier) and what a `model`
names (the base model, an adapter's served versions, a pinned version, or a fine-tuning job's model:
its version or one of its kept checkpoints, serving.contracts.checkpoint_names), cached per process.

This module is the gateway's one database port (serving.gateway.ports.Catalog): the pipeline is
handed it by serving.gateway.wiring and never imports it; the /v1/models views use it directly.

The cache keeps the ORM off the request path: each entry lives GATEWAY_CACHE_SECONDS
(settings.GATEWAY.cache_s, 0.5 s by default) from when its load began, so a revoked key, a
suspended tenant or a new deployment holds on every gateway process within that time. An entry
used past half its life is reloaded in the background while it still answers (serving.gateway.
ttl_cache), and concurrent misses of one entry share one load, so a key or tenant in steady use
never makes a request wait for the database. An adapter's name is answered from its tenant's
served versions, loaded in one query per tenant (not one per model and key), so a tenant calling
many adapters keeps them all warm with the one entry.
Callers choose what is cached (any header, any `model`), so each cache is bounded by entries and
bytes and frees what expired (serving.gateway.ttl_cache).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from django.db.models import Prefetch, Q, Sum
from rest_framework import exceptions

from serving.contracts.checkpoint_names import JobModelName, checkpoint_label, checkpoint_pinned_name, job_model_parse
from serving.contracts.names import parse_qualified_name
from serving.gateway.errors import GatewayError, model_not_found
from serving.gateway.records import Caller, KeyControls, Target, TierLimits
from serving.gateway.ttl_cache import TtlCache
from serving.gateway.version_pick import ServedSet, ServedVersion
from serving.registry.job_models import job_models
from serving.registry.models import Adapter, AdapterVersion, UsageRecord
from serving.registry.selectors import versions_by_precedence
from serving.registry.versions import SEMVER_RE
from tenants.authentication import KEY_EXPIRED, TenantAuth, api_key_authenticate
from tenants.key_controls import model_allowed
from tenants.models import ApiKey

log = logging.getLogger(__name__)

T = TypeVar("T")
_SERVED = (AdapterVersion.Status.ACTIVE, AdapterVersion.Status.CANARY)
# A checkpoint's ServedVersion.status: it is no registry version, so it has none of theirs.
CHECKPOINT_STATUS = "checkpoint"


async def _get_or_load(cache: TtlCache[T], key: Hashable, load: Callable[[], T]) -> T:
    """The cached value of `key`, or `load()`'s (in a thread, as the ORM needs), cached either way:
    a refusal (GatewayError) is cached without its traceback, and a copy raised on every hit. A hit
    past half its life starts a reload in the background (the request does not wait for it)."""
    hit, value = cache.get(key)
    if not hit:
        value = await asyncio.shield(_load_task(cache, key, load))
    elif cache.refresh_due(key):
        _load_task(cache, key, load)
    if isinstance(value, GatewayError):
        raise value.fresh()
    return value  # type: ignore[return-value]


# The loads under way, per (cache, key, loop): a second miss of the same entry waits for the first's.
_loads: dict[tuple[int, Hashable, asyncio.AbstractEventLoop], asyncio.Task] = {}


def _load_task(cache: TtlCache[T], key: Hashable, load: Callable[[], T]) -> asyncio.Task:
    """The load of `key` under way, else a new one; it `put`s what it loaded. Its own task in a fresh
    context: a client that leaves does not cancel it for the others waiting, and its thread is not
    the first request's (sync_to_async's thread-sensitive executor is bound to the context)."""
    loop = asyncio.get_running_loop()
    token = (id(cache), key, loop)
    task = _loads.get(token)
    if task is None:
        task = loop.create_task(_load(cache, key, load), context=contextvars.Context())
        _loads[token] = task
        task.add_done_callback(lambda done: _load_done(token, done))
    return task


def _load_done(token: tuple[int, Hashable, asyncio.AbstractEventLoop], task: asyncio.Task) -> None:
    _loads.pop(token, None)
    if not task.cancelled() and task.exception() is not None:
        # A background reload that failed leaves the entry as it was until it expires; a miss
        # raises the error to its requests.
        log.warning("gateway catalog load failed: %r", task.exception())


async def _load(cache: TtlCache[T], key: Hashable, load: Callable[[], T]) -> T | GatewayError:
    started = cache.now()
    try:
        value: T | GatewayError = await sync_to_async(_with_connection(load))()
    except GatewayError as error:
        value = error.with_traceback(None)  # the load's frames (and what they hold) are not kept
    cache.put(key, value, loaded_at=started)
    return value


def _with_connection(load: Callable[[], T]) -> Callable[[], T]:
    """`load` between connection checks, as Django does around a request: the gateway's fast path
    (serving.gateway.asgi) sends no request signals, and a connection past CONN_MAX_AGE or broken
    must not be reused."""

    def run() -> T:
        close_old_connections()
        try:
            return load()
        finally:
            close_old_connections()

    return run


def _cache_seconds() -> float:
    return settings.GATEWAY.cache_s


# Per process and per cache. Within settings.GATEWAY.cache_s (0.5 s) no process sees anywhere near
# 20,000 distinct keys or models; the byte bound holds whatever callers send (serving.gateway.ttl_cache).
CACHE_MAX_ENTRIES = 20_000
CACHE_MAX_BYTES = 32 * 1024 * 1024
# A Loraplex key is `lp-<prefix ≤ 16>.<secret>` (about 60 characters): a header far longer is
# refused unread, neither looked up nor cached.
AUTHORIZATION_MAX_CHARS = 512
# What each scope lets a key do here, for the message refusing a key without it.
SCOPE_USES: dict[str, str] = {ApiKey.Scope.INFERENCE: "call /v1", ApiKey.Scope.MANAGE: "delete models"}

_callers: TtlCache[Caller] = TtlCache(_cache_seconds, max_entries=CACHE_MAX_ENTRIES, max_bytes=CACHE_MAX_BYTES)
_targets: TtlCache[Target] = TtlCache(_cache_seconds, max_entries=CACHE_MAX_ENTRIES, max_bytes=CACHE_MAX_BYTES)
# Per tenant (id, slug): its adapters that have an active version, by name, as targets.
_tenants: TtlCache[dict[str, Target]] = TtlCache(_cache_seconds, max_entries=CACHE_MAX_ENTRIES,
                                                 max_bytes=CACHE_MAX_BYTES)
_BASE = Target(base=True)


def base_model_ids() -> list[str]:
    """The names that request the base model: its id and the operator's aliases."""
    return [settings.BASE_MODEL_NAME, *settings.BASE_MODEL_ALIASES]


def _header_check(authorization: str | None, scope: str) -> str:
    """The header; 401 for none or one far longer than a key, refused unread (neither looked up nor cached)."""
    if not authorization:
        raise GatewayError(401, "Missing API key: send 'Authorization: Bearer lp-<prefix>.<secret>' (a key with "
                           f"the '{scope}' scope).", code="invalid_api_key")
    if len(authorization) > AUTHORIZATION_MAX_CHARS:
        raise GatewayError(401, f"Malformed Authorization header: it is {len(authorization)} characters long; "
                           "expected 'Authorization: Bearer lp-<prefix>.<secret>'.", code="invalid_api_key")
    return authorization


def key_authenticate(authorization: str | None, *, scope: str) -> TenantAuth:
    """The tenant and key of an `Authorization` header, uncached: 401 for a missing, malformed, wrong,
    revoked or expired key, 403 for a suspended tenant or a key without `scope`."""
    try:
        auth = api_key_authenticate(_header_check(authorization, scope))
    except exceptions.AuthenticationFailed as exc:
        code = KEY_EXPIRED if exc.get_codes() == KEY_EXPIRED else "invalid_api_key"
        raise GatewayError(401, str(exc.detail), code=code) from None
    except exceptions.PermissionDenied as exc:
        raise GatewayError(403, str(exc.detail), code="tenant_suspended") from None
    assert auth.api_key is not None, "api_key_authenticate authenticates by key"
    if not auth.has_scope(scope):
        raise GatewayError(
            403, f"This API key (lp-{auth.api_key.prefix}…) lacks the '{scope}' scope; create a key with it "
            f"to {SCOPE_USES.get(scope, 'do this')}.", code="insufficient_scope")
    return auth


def _load_caller(header: str) -> Caller:
    auth = key_authenticate(header, scope=ApiKey.Scope.INFERENCE)
    key = auth.api_key
    assert key is not None, "key_authenticate authenticates by key"
    tier = auth.tenant.tier
    return Caller(
        tenant_id=auth.tenant.id, tenant=auth.tenant.slug, key_prefix=key.prefix,
        tier=TierLimits(name=tier.name, requests_per_minute=tier.requests_per_minute,
                        tokens_per_minute=tier.tokens_per_minute, max_tokens_per_request=tier.max_tokens_per_request,
                        priority=tier.priority, degradation_allowed=tier.degradation_allowed),
        key=KeyControls(allowed_models=tuple(key.allowed_models), requests_per_minute=key.requests_per_minute,
                        tokens_per_minute=key.tokens_per_minute, monthly_token_budget=key.monthly_token_budget),
    )


async def caller_for(authorization: str | None) -> Caller:
    """The caller of an `Authorization` header (`key_authenticate`'s refusals, for the `inference`
    scope), cached; a header refused before any lookup is not cached."""
    header = _header_check(authorization, ApiKey.Scope.INFERENCE)
    return await _get_or_load(_callers, header, lambda: _load_caller(header))


def _served(version: AdapterVersion, tenant: str, adapter: str) -> ServedVersion:
    return ServedVersion(tenant=tenant, adapter=adapter, version=version.version, artifact_uri=version.artifact_uri,
                         manifest_sha256=version.manifest_sha256, status=version.status)


def model_not_allowed(key_prefix: str, allowed_models: tuple[str, ...], model: str) -> GatewayError:
    allowed = ", ".join(allowed_models)
    return GatewayError(403, f"This API key (lp-{key_prefix}…) may not call '{model:.200}': it is limited to "
                        f"{allowed}. A tenant owner can change the key's allowed models.",
                        code="model_not_allowed", param="model")


def _allowed(caller: Caller, model: str, job_model: JobModelName | None) -> bool:
    """The key's allow-list on `model`; a job's model also by what it stands for: a checkpoint as its
    pinned name (so its adapter's name allows it), a job's version as its adapter."""
    allowed, bases = caller.key.allowed_models, base_model_ids()
    if model_allowed(allowed, model, base_model_ids=bases):
        return True
    return job_model is not None and model_allowed(allowed, job_model.pinned or job_model.adapter, base_model_ids=bases)


def _job_model(caller: Caller, model: str, named: JobModelName) -> ServedVersion:
    """The version a job's model name stands for in the caller's tenant: the job's registered version,
    or its kept checkpoint's artifact, loaded on demand as a pinned version is. Another tenant's job,
    a name whose base, tenant or adapter is not the job's, a checkpoint no longer kept (or saved
    before checkpoints had artifacts): the same 404 as a name that never was."""
    if named.tenant is not None and named.tenant != caller.tenant:
        raise model_not_found(model)
    job = job_models().job(tenant_id=caller.tenant_id, job_id=named.job_id, adapter=named.adapter)
    if job is None or named.base not in (None, job.base_model):
        raise model_not_found(model)
    if named.step is None:
        version = job.version
        if version is None or version.status == AdapterVersion.Status.ARCHIVED:
            raise model_not_found(model)
        return _served(version, caller.tenant, job.adapter)
    checkpoint = job_models().checkpoint(job_id=job.job_id, step=named.step)
    if checkpoint is None:
        raise model_not_found(model)
    if job.base_model_revision != settings.BASE_MODEL_REVISION:
        # As the registry refuses such a version: its weights fit another revision of the base.
        trained, serving = (revision or "(a local directory)"
                            for revision in (job.base_model_revision, settings.BASE_MODEL_REVISION))
        raise GatewayError(409, f"'{model:.200}' was trained on revision {trained} of the base model, which now "
                           f"serves revision {serving}; train it again on this revision.",
                           code="base_model_revision_mismatch", param="model")
    return ServedVersion(tenant=caller.tenant, adapter=job.adapter, version=checkpoint_label(job.job_id, named.step),
                         artifact_uri=checkpoint.artifact_uri, manifest_sha256=checkpoint.manifest_sha256,
                         status=CHECKPOINT_STATUS)


def _load_target(caller: Caller, model: str) -> Target:
    job_model = job_model_parse(model)
    if not _allowed(caller, model, job_model):
        raise model_not_allowed(caller.key_prefix, caller.key.allowed_models, model)
    if model in base_model_ids():
        return Target(base=True)
    if job_model is not None:
        return Target(pinned=_job_model(caller, model, job_model))
    name, _, pinned = model.partition("@")
    adapter = Adapter.objects.filter(tenant_id=caller.tenant_id, name=name).first()
    if adapter is None:
        raise model_not_found(model)
    if pinned:
        if not SEMVER_RE.match(pinned):
            raise model_not_found(model)
        version = adapter.versions.filter(version=pinned).exclude(status=AdapterVersion.Status.ARCHIVED).first()
        if version is None:
            raise model_not_found(model)
        return Target(pinned=_served(version, caller.tenant, name))
    served = {v.status: v for v in adapter.versions.filter(status__in=_SERVED)}
    active, canary = served.get(AdapterVersion.Status.ACTIVE), served.get(AdapterVersion.Status.CANARY)
    if active is None:
        if not adapter.versions.exclude(status=AdapterVersion.Status.ARCHIVED).exists() and adapter.versions.exists():
            raise model_not_found(model)  # every version archived: the model was deleted
        raise GatewayError(404, f"The adapter '{name}' has no active version; deploy one first "
                           f"(or pin a version: '{name}@<version>').", code="model_not_deployed", param="model")
    return Target(served=ServedSet(
        active=_served(active, caller.tenant, name),
        canary=_served(canary, caller.tenant, name) if canary else None,
        canary_weight=canary.canary_weight if canary else 0.0,
    ))


def _load_tenant_served(tenant_id: int, tenant: str) -> dict[str, Target]:
    """What `_load_target` answers for each of the tenant's adapters with an active version, by
    name, in one query."""
    by_adapter: dict[str, dict[str, AdapterVersion]] = {}
    for row in AdapterVersion.objects.filter(adapter__tenant_id=tenant_id, status__in=_SERVED).select_related(
            "adapter"):
        by_adapter.setdefault(row.adapter.name, {})[row.status] = row
    targets = {}
    for name, served in by_adapter.items():
        active, canary = served.get(AdapterVersion.Status.ACTIVE), served.get(AdapterVersion.Status.CANARY)
        if active is not None:
            targets[name] = Target(served=ServedSet(
                active=_served(active, tenant, name), canary=_served(canary, tenant, name) if canary else None,
                canary_weight=canary.canary_weight if canary else 0.0))
    return targets


async def target_for(caller: Caller, model: str) -> Target:
    """What `model` names in the caller's tenant; the same 404 for unknown and foreign names, 403
    model_not_allowed for a name outside the key's allow-list (checked first: the list is the
    caller's own, so it tells nothing of other tenants). The base model and a deployed adapter's
    name (the common requests) come without a load of their own: the base needs none, the adapter
    is in its tenant's served versions; anything else (a pin, a job's model, a refusal) is loaded
    and cached by name."""
    bases = base_model_ids()
    if "@" not in model and job_model_parse(model) is None and model_allowed(
            caller.key.allowed_models, model, base_model_ids=bases):
        if model in bases:
            return _BASE
        served = await _get_or_load(_tenants, (caller.tenant_id, caller.tenant),
                                    lambda: _load_tenant_served(caller.tenant_id, caller.tenant))
        if model in served:
            return served[model]
    return await _get_or_load(_targets, (caller.tenant_id, caller.key_prefix, model),
                              lambda: _load_target(caller, model))


def _load_served_versions(names: list[str]) -> dict[str, ServedVersion]:
    wanted: dict[tuple[str, str, str], str] = {}
    for name in names:
        try:
            parts = parse_qualified_name(name)
        except ValueError:
            continue  # not a registry name: nothing the registry serves
        wanted[(parts.tenant, parts.adapter, parts.version)] = name
    if not wanted:
        return {}
    query = Q()
    for tenant, adapter, version in wanted:
        query |= Q(adapter__tenant__slug=tenant, adapter__name=adapter, version=version)
    found: dict[str, ServedVersion] = {}
    for row in AdapterVersion.objects.filter(query, status__in=_SERVED).select_related("adapter__tenant"):
        qualified = wanted.get((row.adapter.tenant.slug, row.adapter.name, row.version))
        if qualified is not None:
            found[qualified] = _served(row, row.adapter.tenant.slug, row.adapter.name)
    return found


async def served_versions(names: list[str]) -> dict[str, ServedVersion]:
    """The versions among `names` (`<tenant>/<adapter>@<version>`) still served (active or canary),
    by name, for the prewarm loop: one query, uncached (the loop runs every tens of seconds)."""
    return await sync_to_async(_with_connection(lambda: _load_served_versions(names)))()


def _load_key_tokens(tenant_id: int, key_prefix: str, start: float, before: float) -> int:
    totals = UsageRecord.objects.filter(
        tenant_id=tenant_id, api_key_prefix=key_prefix, created_at__gte=datetime.fromtimestamp(start, tz=UTC),
        created_at__lt=datetime.fromtimestamp(before, tz=UTC),
    ).aggregate(prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"))
    return (totals["prompt"] or 0) + (totals["completion"] or 0)


async def key_tokens_recorded(caller: Caller, start: float, before: float) -> int:
    """The tokens the usage records hold for the caller's key in [start, before) (unix seconds):
    what seeds its month's spend counter when Redis has none (serving.gateway.key_budget).
    Uncached: it runs once per key and month, or after Redis lost its data."""
    return await sync_to_async(_with_connection(
        lambda: _load_key_tokens(caller.tenant_id, caller.key_prefix, start, before)))()


@dataclass(frozen=True)
class Servable:
    """A `model` the gateway serves to a tenant: the base model (by one of its names), an adapter by
    name (its active version, and its canary by weight), one version pinned (`adapter@version`), or a
    job's kept checkpoint (its pinned name; `version` holds its step, `status` its job's id)."""

    model: str
    kind: str  # "base", "adapter", "pinned" or "checkpoint"
    adapter: str | None = None
    # The adapter's active version (kind "adapter") or the pinned one (kind "pinned").
    version: str | None = None
    # The pinned version's status; for an adapter, its canary's version and weight if one runs.
    status: str | None = None
    canary: str | None = None
    canary_weight: float = 0.0


def servable_models(tenant_id: int) -> list[Servable]:
    """Every `model` a request of the tenant resolves to (what `target_for` accepts, before a key's
    allow-list): the base model's names, each adapter that has an active version, every version
    not archived, pinned, and every kept checkpoint of its jobs, newest first (by our pinned name;
    OpenAI's `ft:` names resolve to the same). The dashboard's playground lists these."""
    found = [Servable(model=name, kind="base") for name in base_model_ids()]
    adapters = (Adapter.objects.filter(tenant_id=tenant_id).order_by("name")
                .prefetch_related(Prefetch("versions", queryset=AdapterVersion.objects.exclude(
                    status=AdapterVersion.Status.ARCHIVED))))
    for adapter in adapters:
        versions = versions_by_precedence(list(adapter.versions.all()))
        served = {version.status: version for version in versions if version.status in _SERVED}
        active, canary = served.get(AdapterVersion.Status.ACTIVE), served.get(AdapterVersion.Status.CANARY)
        if active is not None:
            found.append(Servable(model=adapter.name, kind="adapter", adapter=adapter.name, version=active.version,
                                  canary=canary.version if canary else None,
                                  canary_weight=canary.canary_weight if canary else 0.0))
        found.extend(Servable(model=f"{adapter.name}@{version.version}", kind="pinned", adapter=adapter.name,
                              version=version.version, status=version.status) for version in versions)
    found.extend(Servable(model=checkpoint_pinned_name(adapter=item.adapter, job_id=item.job_id, step=item.step),
                          kind="checkpoint", adapter=item.adapter, version=str(item.step), status=str(item.job_id))
                 for item in job_models().checkpoints(tenant_id=tenant_id))
    return found


@dataclass(frozen=True)
class ModelEntry:
    id: str
    created: int
    owned_by: str
    parent: str | None
    root: str


def _base_entries() -> list[ModelEntry]:
    return [ModelEntry(id=name, created=0, owned_by="loraplex", parent=None, root=settings.BASE_MODEL_NAME)
            for name in base_model_ids()]


def model_list(caller: Caller) -> list[ModelEntry]:
    """The base model and the caller's deployed adapters (each by name, and each served version
    pinned), as vLLM lists adapters: `parent` is the base model. A key with an allow-list sees only
    what it may call."""
    return [entry for entry in _model_entries(caller)
            if model_allowed(caller.key.allowed_models, entry.id, base_model_ids=base_model_ids())]


def _model_entries(caller: Caller) -> list[ModelEntry]:
    entries = _base_entries()
    versions = (AdapterVersion.objects.filter(adapter__tenant_id=caller.tenant_id, status__in=_SERVED)
                .select_related("adapter").order_by("adapter__name", "status"))
    seen: set[str] = set()
    for version in versions:
        adapter = version.adapter
        created = int(adapter.created_at.timestamp())
        if adapter.name not in seen and version.status == AdapterVersion.Status.ACTIVE:
            seen.add(adapter.name)
            entries.append(ModelEntry(id=adapter.name, created=created, owned_by=caller.tenant,
                                      parent=settings.BASE_MODEL_NAME, root=f"{adapter.name}@{version.version}"))
        entries.append(ModelEntry(id=f"{adapter.name}@{version.version}", created=int(version.created_at.timestamp()),
                                  owned_by=caller.tenant, parent=settings.BASE_MODEL_NAME,
                                  root=f"{adapter.name}@{version.version}"))
    return entries


def model_get(caller: Caller, model: str) -> ModelEntry:
    """One model the caller may request (an adapter, a pinned non-archived version, the base)."""
    for entry in _base_entries():
        if entry.id == model:
            return entry
    target = _load_target(caller, model)
    version = target.pinned or (target.served.active if target.served else None)
    assert version is not None, "a model other than the base resolves to a pin or an adapter's served set"
    # A checkpoint's adapter has no row before the job's first version is registered.
    adapter = Adapter.objects.filter(tenant_id=caller.tenant_id, name=version.adapter).first()
    return ModelEntry(id=model, created=int(adapter.created_at.timestamp()) if adapter else 0, owned_by=caller.tenant,
                      parent=settings.BASE_MODEL_NAME, root=f"{version.adapter}@{version.version}")


def targets_forget() -> None:
    """Forget what every `model` resolved to in this process (after a deletion here: other
    processes see it within GATEWAY_CACHE_SECONDS)."""
    _targets.clear()
    _tenants.clear()


def caches_clear() -> None:
    """Forget every cached key and model (tests; an operator's shell after a bulk change)."""
    _callers.clear()
    _targets.clear()
    _tenants.clear()
