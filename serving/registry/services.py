"""Every change to the adapter registry: adapters, versions, deployment, canary, rollback, archive.

Each operation runs in one transaction that first locks the adapter's row (SELECT … FOR UPDATE),
so two operations on one adapter run one after the other and each sees the other's result; the
partial unique constraints in serving.registry.models back the invariants up. Every state change writes
exactly one DeploymentEvent (the audit log) in the same transaction and publishes it on Redis once
the transaction commits (serving.registry.events). API views, admin actions, the `registry` command and
training all call these functions; none of them holds a rule of its own.

The deployment operations take `dry_run`: the same lock and the same checks, raising the same
errors, and no change; the admin's confirmation pages preview an action that way. A dry run of an
operation that takes a weight may pass `weight=None` to run only the checks that need no weight.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from functools import partial

from django.conf import settings
from django.core.files.uploadedfile import UploadedFile
from django.db import IntegrityError, transaction

from serving.contracts.errors import Conflict, InvalidInput, NotFound
from serving.registry.storage import get_storage
from serving.registry import selectors, uploads
from serving.registry.adapter_names import adapter_name_validate, adapter_room_check
from serving.registry.events import deploy_event_publish, event_payload
from serving.registry.models import Adapter, AdapterVersion, DeploymentEvent, artifact_prefix
from serving.registry.versions import version_next_patch, version_parse
from tenants.models import Tenant

logger = logging.getLogger(__name__)

Status = AdapterVersion.Status
Kind = DeploymentEvent.Kind


# --- helpers ----------------------------------------------------------------------------------


def _lock(adapter: Adapter) -> Adapter:
    """The adapter's row, locked until the transaction ends; NotFound if it was deleted meanwhile."""
    locked = (Adapter.objects.select_for_update(of=("self",)).select_related("tenant", "tenant__tier")
              .filter(pk=adapter.pk).first())
    if locked is None:
        raise NotFound(f"No adapter named '{adapter.name}'.", code="adapter_not_found")
    return locked


def _fresh_version(adapter: Adapter, version: AdapterVersion) -> AdapterVersion:
    """The version's current row, read after the adapter lock so its status is up to date."""
    fresh = adapter.versions.filter(pk=version.pk).first()
    if fresh is None:
        raise NotFound(f"Adapter '{adapter.name}' has no version '{version.version}'.", code="version_not_found")
    fresh.adapter = adapter
    return fresh


def _require_actor(actor: str) -> str:
    if not isinstance(actor, str) or not actor.strip():
        raise InvalidInput("Every registry change needs an actor for the audit log.", param="actor")
    return actor.strip()[:200]


def _weight(weight: object) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise InvalidInput(f"The canary weight must be a number from 0 to 1, got {weight!r}.",
                           code="invalid_weight", param="weight")
    if not 0.0 <= weight <= 1.0:
        raise InvalidInput(f"The canary weight must be within 0 and 1 (a share of traffic), got {weight}.",
                           code="invalid_weight", param="weight")
    return float(weight)


def _record(*, adapter: Adapter, kind: str, actor: str, reason: str = "",
            from_version: AdapterVersion | None = None, to_version: AdapterVersion | None = None,
            from_weight: float | None = None, to_weight: float | None = None,
            dropped: Sequence[AdapterVersion] = (), stops_serving: bool = False) -> DeploymentEvent:
    """Writes the audit event of a change and schedules its Redis message for after the commit.

    The message is built now, inside the transaction, so it describes exactly the committed state
    (`stops_serving`: the adapter is about to be deleted, so nothing of it is served any more).
    """
    event = DeploymentEvent.objects.create(
        tenant=adapter.tenant, adapter=adapter, adapter_name=adapter.name, kind=kind, actor=_require_actor(actor),
        reason=reason or "", from_version=from_version.version if from_version else "",
        to_version=to_version.version if to_version else "", from_weight=from_weight, to_weight=to_weight,
    )
    payload = event_payload(
        event=event,
        served=[] if stops_serving else selectors.adapter_served_entries(adapter=adapter),
        dropped=[selectors.version_entry(item, weight=None) for item in dropped],
    )
    transaction.on_commit(partial(deploy_event_publish, payload))
    return event


def _set_status(version: AdapterVersion, status: str, weight: float | None = None) -> None:
    version.status = status
    version.traffic_weight = weight
    version.save(update_fields=["status", "traffic_weight"])


def _require_servable(version: AdapterVersion) -> None:
    """Only ready or deprecated versions built for the platform's base model may start serving."""
    if version.status == Status.ARCHIVED:
        raise Conflict(f"Version {version.version} is archived; archived versions are never served.",
                       code="version_archived")
    if version.base_model != settings.BASE_MODEL_NAME:
        raise Conflict(
            f"Version {version.version} was built for base model '{version.base_model}', but this platform "
            f"serves '{settings.BASE_MODEL_NAME}'.", code="base_model_mismatch",
        )
    # A plain directory has no revision (""): only two known commits can differ.
    if version.base_model_revision and settings.BASE_MODEL_REVISION \
            and version.base_model_revision != settings.BASE_MODEL_REVISION:
        raise Conflict(
            f"Version {version.version} was built on revision {version.base_model_revision} of base model "
            f"'{version.base_model}', but this platform serves revision {settings.BASE_MODEL_REVISION}.",
            code="base_model_revision_mismatch",
        )


def _require_no_canary(canary: AdapterVersion | None, what: str) -> None:
    if canary is not None:
        raise Conflict(
            f"Version {canary.version} is running as a canary ({canary.traffic_weight:.0%} of traffic); "
            f"promote or abort it before you {what}.", code="canary_running",
        )


# --- adapters ---------------------------------------------------------------------------------


def _adapter_create_locked(*, tenant: Tenant, name: str, description: str) -> Adapter:
    """Creates the adapter; the caller holds the tenant's row lock, so the count is exact."""
    adapter_room_check(tenant=tenant, name=name)
    try:
        with transaction.atomic():
            return Adapter.objects.create(tenant=tenant, name=name, description=description)
    except IntegrityError:
        raise Conflict(f"An adapter named '{name}' already exists.", code="adapter_exists", param="name") from None


def _lock_tenant(tenant: Tenant) -> Tenant:
    return Tenant.objects.select_for_update(of=("self",)).select_related("tier").get(pk=tenant.pk)


def adapter_create(*, tenant: Tenant, name: str, description: str = "") -> Adapter:
    """A new, empty adapter; counts against the tier's max adapters (LimitExceeded beyond it)."""
    adapter_name_validate(name)
    with transaction.atomic():
        return _adapter_create_locked(tenant=_lock_tenant(tenant), name=name, description=description or "")


def adapter_delete(*, adapter: Adapter, actor: str, force: bool = False, reason: str = "") -> DeploymentEvent:
    """Deletes the adapter, its versions and their artifacts; refused while it serves unless forced.

    The audit log keeps the deletion (and every earlier event) with the adapter's name. Artifacts
    are deleted after the commit, so a failed transaction never loses the files of live rows.
    """
    with transaction.atomic():
        adapter = _lock(adapter)
        active, canary = selectors.adapter_served(adapter=adapter)
        served = [item for item in (active, canary) if item]
        if served and not force:
            serving = ", ".join(f"{item.version} ({item.status})" for item in served)
            raise Conflict(
                f"Adapter '{adapter.name}' is serving {serving}; archive its versions first, or delete with "
                "force to stop serving it at once.", code="adapter_serving",
            )
        event = _record(adapter=adapter, kind=Kind.DELETE, actor=actor, reason=reason,
                        from_version=active, dropped=served, stops_serving=True)
        prefix = adapter.storage_prefix
        adapter.delete()
        transaction.on_commit(partial(_delete_artifacts, prefix))
    return event


def _delete_artifacts(prefix: str) -> None:
    """Deletes what is stored under prefix; a failure is logged (it must not hide the caller's error)."""
    try:
        get_storage().delete_prefix(prefix)
    except Exception:
        logger.exception("Could not delete the artifacts under %s; delete them by hand", prefix)


# --- registering versions ---------------------------------------------------------------------


def _version_for(adapter: Adapter, version: str | None) -> str:
    if version is None or version == "":
        return version_next_patch(adapter.versions.values_list("version", flat=True))
    version_parse(version)
    if adapter.versions.filter(version=version).exists():
        raise Conflict(f"Adapter '{adapter.name}' already has a version {version}; versions are immutable, "
                       "so choose a new one.", code="version_exists", param="version")
    return version


def adapter_version_upload(*, adapter: Adapter, files: Sequence[UploadedFile], actor: str,
                           version: str | None = None, reason: str = "") -> AdapterVersion:
    """Registers a tenant's own PEFT adapter (status ready) from uploaded files or one archive.

    Validation (serving.registry.uploads) happens before anything is stored. Then, holding the adapter's
    lock, the artifact with its manifest is published and the row and its event are written; if the
    row cannot be written the published artifact is deleted again, so nothing is left either way.
    `version` defaults to the next patch release.
    """
    _require_actor(actor)
    if version:
        version_parse(version)
    with uploads.staged_upload(files) as staged:
        published_prefix: str | None = None
        storage = get_storage()
        try:
            with transaction.atomic():
                adapter = _lock(adapter)
                chosen = _version_for(adapter, version)
                prefix = artifact_prefix(tenant=adapter.tenant.slug, adapter=adapter.name, version=chosen)
                manifest_sha256 = uploads.manifest_write_for(
                    staged, tenant=adapter.tenant.slug, adapter=adapter.name, version=chosen,
                )
                storage.publish_directory(staged.directory, prefix, marker=uploads.MANIFEST_NAME)
                published_prefix = prefix
                created = AdapterVersion.objects.create(
                    adapter=adapter, version=chosen, artifact_uri=storage.uri(prefix) + "/",
                    manifest_sha256=manifest_sha256, base_model=settings.BASE_MODEL_NAME,
                    base_model_revision=settings.BASE_MODEL_REVISION, rank=staged.rank,
                    lora_alpha=staged.lora_alpha, target_modules=staged.target_modules, kind=staged.kind,
                    size_bytes=staged.size_bytes, source=AdapterVersion.Source.UPLOAD,
                )
                _record(adapter=adapter, kind=Kind.REGISTER, actor=actor, reason=reason, to_version=created)
        except BaseException:
            if published_prefix is not None:
                _delete_artifacts(published_prefix)
            raise
    return created


def adapter_version_register(*, tenant: Tenant, adapter_name: str, version: str, artifact_prefix: str,
                             training_job_id: str, base_model_revision: str | None = None,
                             actor: str | None = None, reason: str = "") -> AdapterVersion:
    """Registers an artifact a training job already published (status ready), all or nothing.

    The adapter is created if the tenant has none of that name (tier limit applies). The artifact
    is verified as thoroughly as an upload: every file against its manifest, the manifest against
    this tenant, adapter, version and base model, the adapter against the base's layer sizes.
    Idempotent for redelivered tasks: registering the same artifact again for the same job returns
    the existing version without a second event; any other clash of versions is a Conflict. The
    artifact belongs to the caller: this function never deletes it. `base_model_revision` is the
    base's commit the job trained on (default: the platform's now), recorded on the version.
    """
    return adapter_version_register_published(
        tenant=tenant, adapter_name=adapter_name, version=version, artifact_prefix=artifact_prefix,
        base_model_revision=base_model_revision,
        expected_source=(AdapterVersion.Source.TRAINING_JOB, str(training_job_id)),
        actor=actor or f"training-job:{training_job_id}", reason=reason,
    )


def adapter_version_register_published(*, tenant: Tenant, adapter_name: str, version: str, artifact_prefix: str,
                               actor: str, expected_source: tuple[str, str] | None = None,
                               reason: str = "", base_model_revision: str | None = None) -> AdapterVersion:
    """Registers a verified artifact already in storage; its source comes from its manifest.

    `expected_source` (kind, id), when given, must match the manifest's. `base_model_revision`
    (default: the platform's base revision now) is recorded on the version. Used by training (through
    adapter_version_register) and by `registry import`, which restores versions whose artifacts
    survived.
    """
    version_parse(version)
    actor = _require_actor(actor)
    prefix = artifact_prefix.rstrip("/")
    artifact = uploads.published_artifact_verify(prefix=prefix, tenant=tenant.slug, adapter=adapter_name,
                                                 version=version)
    source_id = artifact.source_id if artifact.source_kind == AdapterVersion.Source.TRAINING_JOB else ""
    if expected_source is not None and expected_source != (artifact.source_kind, source_id):
        raise InvalidInput(f"The manifest at '{prefix}/' records source {artifact.source_kind} {source_id!r}, "
                           f"not {expected_source[0]} {expected_source[1]!r}.", code="manifest_mismatch")
    with transaction.atomic():
        locked_tenant = _lock_tenant(tenant)
        adapter = Adapter.objects.filter(tenant=locked_tenant, name=adapter_name).first()
        if adapter is None:
            adapter_name_validate(adapter_name)
            adapter = _adapter_create_locked(tenant=locked_tenant, name=adapter_name, description="")
        adapter = _lock(adapter)
        existing = adapter.versions.filter(version=version).first()
        if existing is not None:
            if existing.manifest_sha256 == artifact.manifest_sha256 and existing.source_id == source_id:
                return existing
            raise Conflict(f"Adapter '{adapter_name}' already has a version {version} from another source.",
                           code="version_exists", param="version")
        created = AdapterVersion.objects.create(
            adapter=adapter, version=version, artifact_uri=get_storage().uri(prefix) + "/",
            manifest_sha256=artifact.manifest_sha256, base_model=settings.BASE_MODEL_NAME,
            base_model_revision=settings.BASE_MODEL_REVISION if base_model_revision is None else base_model_revision,
            rank=artifact.rank,
            lora_alpha=artifact.lora_alpha, target_modules=artifact.target_modules, size_bytes=artifact.size_bytes,
            source=artifact.source_kind, source_id=source_id, kind=artifact.kind,
        )
        _record(adapter=adapter, kind=Kind.REGISTER, actor=actor, reason=reason, to_version=created)
    return created


# --- deployment -------------------------------------------------------------------------------


def adapter_version_deploy(*, version: AdapterVersion, actor: str, reason: str = "",
                           dry_run: bool = False) -> AdapterVersion:
    """Makes the version active; the previously active version becomes deprecated.

    Refused while a canary runs (promote or abort it first), for archived versions, for a version
    built on another base model, and for the version already active.
    """
    with transaction.atomic():
        adapter = _lock(version.adapter)
        version = _fresh_version(adapter, version)
        active, canary = selectors.adapter_served(adapter=adapter)
        if active is not None and active.pk == version.pk:
            raise Conflict(f"Version {version.version} is already the active version.", code="already_active")
        if canary is not None and canary.pk == version.pk:
            raise Conflict(f"Version {version.version} is the running canary; promote it instead.",
                           code="canary_running")
        _require_no_canary(canary, "deploy another version")
        _require_servable(version)
        if dry_run:
            return version
        if active is not None:
            _set_status(active, Status.DEPRECATED)
        _set_status(version, Status.ACTIVE)
        _record(adapter=adapter, kind=Kind.DEPLOY, actor=actor, reason=reason, from_version=active,
                to_version=version, dropped=[active] if active else [])
    return version


def adapter_canary_start(*, version: AdapterVersion, weight: float | None, actor: str, reason: str = "",
                         dry_run: bool = False) -> AdapterVersion:
    """Serves the version beside the active one, to `weight` (0–1) of the adapter's traffic."""
    checked = None if dry_run and weight is None else _weight(weight)
    with transaction.atomic():
        adapter = _lock(version.adapter)
        version = _fresh_version(adapter, version)
        active, canary = selectors.adapter_served(adapter=adapter)
        if active is None:
            raise Conflict(f"Adapter '{adapter.name}' has no active version; a canary runs beside one, so "
                           "deploy a version first.", code="no_active_version")
        if active.pk == version.pk:
            raise Conflict(f"Version {version.version} is the active version; a canary must be another version.",
                           code="already_active")
        _require_no_canary(canary, "start another canary")
        _require_servable(version)
        if dry_run or checked is None:
            return version
        _set_status(version, Status.CANARY, checked)
        _record(adapter=adapter, kind=Kind.CANARY_START, actor=actor, reason=reason, from_version=active,
                to_version=version, to_weight=checked)
    return version


def _locked_canary(adapter: Adapter) -> tuple[Adapter, AdapterVersion | None, AdapterVersion]:
    adapter = _lock(adapter)
    active, canary = selectors.adapter_served(adapter=adapter)
    if canary is None:
        raise Conflict(f"Adapter '{adapter.name}' has no canary running.", code="no_canary")
    return adapter, active, canary


def adapter_canary_set_weight(*, adapter: Adapter, weight: float | None, actor: str, reason: str = "",
                              dry_run: bool = False) -> AdapterVersion:
    """Changes the canary's share of traffic (0–1)."""
    checked = None if dry_run and weight is None else _weight(weight)
    with transaction.atomic():
        adapter, _, canary = _locked_canary(adapter)
        previous = canary.traffic_weight
        if checked is not None and previous == checked:
            raise Conflict(f"The canary already receives a weight of {checked}.", code="weight_unchanged")
        if dry_run or checked is None:
            return canary
        _set_status(canary, Status.CANARY, checked)
        _record(adapter=adapter, kind=Kind.CANARY_WEIGHT, actor=actor, reason=reason, from_version=canary,
                to_version=canary, from_weight=previous, to_weight=checked)
    return canary


def adapter_canary_promote(*, adapter: Adapter, actor: str, reason: str = "", dry_run: bool = False) -> AdapterVersion:
    """The canary becomes the active version; the old active version becomes deprecated."""
    with transaction.atomic():
        adapter, active, canary = _locked_canary(adapter)
        if dry_run:
            return canary
        weight = canary.traffic_weight
        if active is not None:
            _set_status(active, Status.DEPRECATED)
        _set_status(canary, Status.ACTIVE)
        _record(adapter=adapter, kind=Kind.PROMOTE, actor=actor, reason=reason, from_version=active,
                to_version=canary, from_weight=weight, dropped=[active] if active else [])
    return canary


def adapter_canary_abort(*, adapter: Adapter, actor: str, reason: str = "", dry_run: bool = False) -> AdapterVersion:
    """Stops the canary (it becomes deprecated); all traffic returns to the active version."""
    with transaction.atomic():
        adapter, active, canary = _locked_canary(adapter)
        if dry_run:
            return canary
        weight = canary.traffic_weight
        _set_status(canary, Status.DEPRECATED)
        _record(adapter=adapter, kind=Kind.ABORT, actor=actor, reason=reason, from_version=canary,
                to_version=active, from_weight=weight, dropped=[canary])
    return canary


def adapter_rollback(*, adapter: Adapter, actor: str, version: str | None = None, reason: str = "",
                     dry_run: bool = False) -> AdapterVersion:
    """Makes the previously active version active again; the current one becomes deprecated.

    "Previously active" comes from the audit log (see selectors.adapter_rollback_target), so
    repeated rollbacks walk back through history. `version` names an earlier deprecated version to
    return to instead. Refused while a canary runs: abort it, which already restores the active one.
    """
    with transaction.atomic():
        adapter = _lock(adapter)
        active, canary = selectors.adapter_served(adapter=adapter)
        if active is None:
            raise Conflict(f"Adapter '{adapter.name}' has no active version to roll back from.",
                           code="no_active_version")
        _require_no_canary(canary, "roll back")
        target_name = version or selectors.adapter_rollback_target(adapter=adapter, active=active)
        if target_name is None:
            raise Conflict(f"Version {active.version} is the first version adapter '{adapter.name}' served; "
                           "there is nothing earlier to roll back to.", code="no_previous_version")
        target = adapter.versions.filter(version=target_name).first()
        if target is None:
            raise NotFound(f"Adapter '{adapter.name}' has no version '{target_name}'.", code="version_not_found",
                           param="version")
        target.adapter = adapter
        if target.pk == active.pk:
            raise Conflict(f"Version {target.version} is already the active version.", code="already_active")
        if target.status != Status.DEPRECATED:
            raise Conflict(f"Version {target.version} is {target.status}; a rollback returns to a version that "
                           "served before (deprecated). Deploy it instead.", code="not_a_previous_version")
        _require_servable(target)
        if dry_run:
            return target
        _set_status(active, Status.DEPRECATED)
        _set_status(target, Status.ACTIVE)
        _record(adapter=adapter, kind=Kind.ROLLBACK, actor=actor, reason=reason, from_version=active,
                to_version=target, dropped=[active])
    return target


def adapter_version_archive(*, version: AdapterVersion, actor: str, reason: str = "", force: bool = False,
                            dry_run: bool = False) -> AdapterVersion:
    """Retires a version for good: it is never served again (its artifact stays for the record).

    A served version is refused unless `force`, which stops serving it at once (the event drops it);
    even forced, the active version waits for a running canary to go first (a canary needs one)."""
    with transaction.atomic():
        adapter = _lock(version.adapter)
        version = _fresh_version(adapter, version)
        if version.status == Status.ARCHIVED:
            raise Conflict(f"Version {version.version} is already archived.", code="version_archived")
        if version.status == Status.ACTIVE and not force:
            raise Conflict(f"Version {version.version} is active; deploy or roll back to another version before "
                           "archiving it.", code="version_serving")
        if version.status == Status.CANARY and not force:
            raise Conflict(f"Version {version.version} is the running canary; abort it before archiving it.",
                           code="version_serving")
        if version.status == Status.ACTIVE:
            _require_no_canary(selectors.adapter_served(adapter=adapter)[1], "archive the active version")
        if dry_run:
            return version
        served = version.is_served
        _set_status(version, Status.ARCHIVED)
        _record(adapter=adapter, kind=Kind.ARCHIVE, actor=actor, reason=reason, to_version=version,
                dropped=[version] if served else [])
    return version


def adapter_archive(*, adapter: Adapter, actor: str, reason: str = "", force: bool = False) -> list[AdapterVersion]:
    """Archives every version of the adapter not archived yet (one event each), all or none: what
    deleting a fine-tuned model through /v1 does. Refused (`adapter_serving`) while a version is
    served unless `force`, which archives the canary, then the active version, first."""
    with transaction.atomic():
        adapter = _lock(adapter)
        served = [item for item in selectors.adapter_served(adapter=adapter) if item]
        if served and not force:
            serving = ", ".join(f"{item.version} ({item.status})" for item in served)
            raise Conflict(f"Adapter '{adapter.name}' is serving {serving}; archive with force to stop serving "
                           "it at once.", code="adapter_serving")
        first: dict[str, int] = {Status.CANARY: 0, Status.ACTIVE: 1}
        versions = sorted(adapter.versions.exclude(status=Status.ARCHIVED), key=lambda item: first.get(item.status, 2))
        return [adapter_version_archive(version=item, actor=actor, reason=reason, force=force) for item in versions]
