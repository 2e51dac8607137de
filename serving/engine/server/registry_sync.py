"""Keeping the registry's served versions loaded on this worker (docs/registry.md, the registry's
side; docs/serving-worker.md, this one).

Three inputs, one outcome: the snapshot (`GET <registry-url>`, every active and canary version)
at start and every `--registry-reconcile-interval` seconds, and the deploy events on Redis
(`serving.contracts.registry.events_channel`) in between; the entries are `serving.contracts.registry`'s typed ones. Each served version is loaded under its qualified name
`<tenant>/<adapter>@<version>` from its artifact URI; versions that stop being served are unloaded.
Pub/sub delivers at most once, so a lost event only delays convergence until the next reconcile.

Ordering: the snapshot carries `revision`, the id of the newest audit event it reflects. Changes
are applied one at a time under a lock; an event whose id is not above the last applied revision
is already reflected and skipped, and a snapshot older than an applied event is ignored (the next
one will be newer), so a late snapshot never undoes a newer event.

Names of the registry's form, `<tenant>/<adapter>@<version>`, belong to the registry, whoever
loaded them: a served version whose loaded content differs from the registry's manifest digest is
reloaded from its artifact (an in-place replacement is undone; the operator's load of a registry
name over the HTTP API sets off a reconcile at once), and a registry-form name the
registry does not serve is unloaded, unless it was loaded after the snapshot being applied was
taken (it may be newer than the snapshot). Other names (`--lora-modules`, `/v1/load_lora_adapter`)
are never touched. The public load/unload API refuses registry-form names to all but the operator.

A version built on another commit of the base model than this worker serves (both known: a plain
directory has none) is refused, not loaded: its weights were fitted to other base weights. The
log line names both revisions; `revision_refusals` counts them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import httpx
import redis.asyncio as aioredis

from serving.engine import AdapterError, AdapterNotFoundError
from serving.engine.server.adapters import AdapterSet, ServedAdapter, Source
from serving.contracts.names import in_registry_form
from serving.contracts.registry import DeployEvent, RegistrySnapshot, ServedEntry, events_channel

log = logging.getLogger(__name__)

# Parallel artifact fetches while applying a snapshot; the engine's loader threads bound the rest.
_PARALLEL_LOADS = 4


@dataclass
class SyncStats:
    snapshots: int = 0
    snapshot_failures: int = 0
    events: int = 0
    load_failures: int = 0
    revision: int = 0
    revision_refusals: int = 0


class RegistrySync:
    def __init__(
        self,
        adapters: AdapterSet,
        *,
        snapshot_url: str,
        token: str,
        redis_url: str | None,
        reconcile_interval: float,
        base_revision: str | None = None,
    ) -> None:
        self._adapters = adapters
        self._base_revision = base_revision
        self._snapshot_url = snapshot_url
        self._headers = {"Authorization": f"Bearer {token}"}
        self._redis_url = redis_url
        self._interval = reconcile_interval
        self._lock = asyncio.Lock()
        self._reconcile_now = asyncio.Event()
        self.stats = SyncStats()

    async def run(self) -> None:
        """Reconcile now and periodically, and follow deploy events, until cancelled."""
        tasks = [asyncio.create_task(self._reconcile_loop(), name="registry-reconcile")]
        if self._redis_url:
            tasks.append(asyncio.create_task(self._follow_events(self._redis_url), name="registry-events"))
        else:
            log.warning("no Redis URL: deploy events are not followed; the registry is polled every %.0fs", self._interval)
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def reconcile_soon(self) -> None:
        """Reconcile now rather than at the next interval (a registry name was changed by hand)."""
        self._reconcile_now.set()

    # ---- snapshot ------------------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        async with httpx.AsyncClient(timeout=30.0, headers=self._headers) as client:
            while True:
                self._reconcile_now.clear()
                try:
                    await self.reconcile(client)
                except (httpx.HTTPError, ValueError) as exc:
                    self.stats.snapshot_failures += 1
                    log.warning("registry snapshot from %s failed (retrying in %.0fs): %s", self._snapshot_url, self._interval, exc)
                try:
                    await asyncio.wait_for(self._reconcile_now.wait(), timeout=self._interval)
                except TimeoutError:
                    pass

    async def reconcile(self, client: httpx.AsyncClient) -> None:
        async with self._lock:
            asked_at = time.monotonic()
            response = await client.get(self._snapshot_url)
            if response.status_code != 200:
                raise ValueError(f"HTTP {response.status_code}: {response.text[:300]}")
            snapshot = RegistrySnapshot.from_dict(response.json())
            revision = snapshot.revision
            if revision < self.stats.revision:
                log.info("registry snapshot at revision %d is older than applied event %d; skipped", revision, self.stats.revision)
                return
            desired = snapshot.adapters
            stale = {name for name, served in self._registry_names().items() if served.loaded_at < asked_at}
            await self._apply(desired, stale=stale)
            self.stats.revision = revision
            self.stats.snapshots += 1

    # ---- events --------------------------------------------------------------------------

    async def _follow_events(self, redis_url: str) -> None:
        while True:
            client = aioredis.Redis.from_url(redis_url)
            try:
                async with client.pubsub() as pubsub:
                    await pubsub.subscribe(events_channel(int(client.connection_pool.connection_kwargs.get("db", 0))))
                    # Events published while unsubscribed are lost: catch up from the snapshot.
                    self._reconcile_now.set()
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            await self._on_event(message["data"])
            except (aioredis.RedisError, OSError) as exc:
                log.warning("deploy events from Redis interrupted (resubscribing in 1s): %s", exc)
                await asyncio.sleep(1.0)
            finally:
                await client.aclose()

    async def _on_event(self, data: bytes | str) -> None:
        try:
            event = DeployEvent.from_dict(json.loads(data))
            event_id, prefix, served = event.id, event.name_prefix, event.served
        except ValueError as exc:
            log.warning("ignoring a malformed deploy event (%s): %.300r", exc, data)
            return
        async with self._lock:
            if event_id <= self.stats.revision:
                return
            if event_id > self.stats.revision + 1:
                # Ids of audit events we never saw: they may be lost, or just other transactions'.
                self._reconcile_now.set()
            self.stats.events += 1
            # `served` is the adapter's complete served set: any other version of it goes.
            await self._apply(served, stale={name for name in self._registry_names() if name.startswith(prefix)})
            self.stats.revision = event_id

    # ---- applying ------------------------------------------------------------------------

    def _registry_names(self) -> dict[str, ServedAdapter]:
        return {name: served for name, served in self._adapters.all().items() if in_registry_form(name)}

    async def _apply(self, desired: Iterable[ServedEntry], *, stale: set[str]) -> None:
        """Load every desired version not loaded with its digest; unload `stale` names not desired."""
        desired = [version for version in desired if self._same_base(version)]
        keep = {version.name for version in desired}
        for name in sorted(stale - keep):
            try:
                await self._adapters.unload(name)
            except AdapterNotFoundError:
                pass
        missing = [v for v in desired if (s := self._adapters.get(v.name)) is None or s.info.digest != v.manifest_sha256]
        gate = asyncio.Semaphore(_PARALLEL_LOADS)

        async def load(version: ServedEntry) -> None:
            async with gate:
                await self._load(version)

        await asyncio.gather(*(load(version) for version in missing))

    def _same_base(self, version: ServedEntry) -> bool:
        if not (version.base_model_revision and self._base_revision) or version.base_model_revision == self._base_revision:
            return True
        self.stats.revision_refusals += 1
        log.error("registry version %s was built on revision %s of base model %s, but this worker serves revision %s; "
                  "not serving it", version.name, version.base_model_revision, version.base_model, self._base_revision)
        return False

    async def _load(self, version: ServedEntry) -> None:
        current = self._adapters.get(version.name)
        if current is not None:
            log.warning("registry version %s is loaded with digest %s, the registry recorded %s; restoring it from %s",
                        version.name, current.info.digest, version.manifest_sha256, version.artifact_uri)
        try:
            info = await self._adapters.load(
                version.name, version.artifact_uri, load_inplace=True, source=Source.REGISTRY
            )
        except (AdapterError, ValueError) as exc:
            self.stats.load_failures += 1
            log.error("registry version %s could not be loaded from %s: %s", version.name, version.artifact_uri, exc)
            return
        if info.digest != version.manifest_sha256:
            # The artifact changed after the registry recorded it: serving it would serve content
            # nobody reviewed. Unload it; the next reconcile retries.
            self.stats.load_failures += 1
            log.error(
                "registry version %s: artifact %s has manifest sha256 %s, the registry recorded %s; not serving it",
                version.name, version.artifact_uri, info.digest, version.manifest_sha256,
            )
            await self._adapters.unload(version.name)
