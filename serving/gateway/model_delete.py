"""`DELETE /v1/models/{id}`: a tenant deletes a fine-tuned model of its own, as OpenAI's API lets an
organisation delete its fine-tuned models, answered in OpenAI's shape
`{"id": ..., "object": "model", "deleted": true}` (serving.gateway.views is the route).

Deleting archives, through the registry's services (serving.registry.services), so the rules, the lock and
the audit log are the registry's: `<adapter>` archives every version of the adapter not archived
yet (`adapter_archive`), `<adapter>@<version>` that one version (`adapter_version_archive`); one
`archive` event per version, with the key as actor (`api-key:<prefix>`) and `?reason=` (default:
the request). Archived versions are never served again; their artifacts and the adapter's row and
history stay, and a new version of the adapter makes it a model again.

- The key needs the `manage` scope (a registry change, as on /api/v1/), and a key with an
  allow-list may delete only what it may call (403 `model_not_allowed`).
- A served model (an active or canary version) is refused, 409 `adapter_serving` or
  `version_serving`, unless `?force=true`, which stops serving it at once.
- The base model and its aliases: 403 `model_not_deletable`.
- A fine-tuning job's models (serving.contracts.checkpoint_names): its `ft:…:ftjob-<n>` name is the version
  the job registered, deleted as `<adapter>@<version>` is; a kept checkpoint's name (`ft:…:ckpt-step-<N>`
  or `<adapter>@ftjob-<n>:ckpt-step-<N>`) is served from the job's checkpoints, not the registry,
  and is refused 403 `checkpoint_not_deletable` saying so (it was a 404 "does not exist" for a
  model the same key could call: issue 37, item 8).
- Another tenant's model, an unknown one and one already deleted are one 404 (`model_not_found`,
  catalog.model_not_found's body): nothing tells them apart.
- The deletion holds at once in this process (its cache of models is cleared) and in the others
  within GATEWAY_CACHE_SECONDS.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from serving.contracts.checkpoint_names import JobModelName, job_model_parse
from serving.contracts.errors import NotFound, ServiceError
from serving.gateway.catalog import base_model_ids, key_authenticate, model_not_allowed, targets_forget
from serving.gateway.errors import GatewayError, invalid_request, model_not_found
from serving.registry import services
from serving.registry.job_models import job_models
from serving.registry.models import Adapter, AdapterVersion
from serving.registry.versions import SEMVER_RE
from tenants.key_controls import model_allowed
from tenants.models import ApiKey, Tenant

QUERY_PARAMS = ("force", "reason")
_FLAGS = {"true": True, "1": True, "false": False, "0": False}
REASON_MAX_CHARS = 1000
_SERVING_CODES = frozenset({"adapter_serving", "version_serving"})


def _delete_query(query: Mapping[str, list[str]]) -> tuple[bool, str]:
    """(force, reason) of the request's query; 400 naming an unknown, repeated or bad parameter."""
    for name, values in query.items():
        if name not in QUERY_PARAMS:
            raise invalid_request(f"Unknown query parameter '{name:.100}'; DELETE /v1/models/{{id}} takes "
                                  f"{', '.join(QUERY_PARAMS)}.", param=name[:100], code="unknown_parameter")
        if len(values) > 1:
            raise invalid_request(f"The query parameter '{name}' is given {len(values)} times; give it once.",
                                  param=name)
    force_text = query.get("force", ["false"])[0]
    force = _FLAGS.get(force_text.lower())
    if force is None:
        raise invalid_request(f"force must be true or false, got '{force_text:.100}'.", param="force")
    reason = query.get("reason", [""])[0]
    if len(reason) > REASON_MAX_CHARS:
        raise invalid_request(f"reason is {len(reason)} characters long; at most {REASON_MAX_CHARS} are kept.",
                              param="reason")
    return force, reason


def model_delete(authorization: str | None, model: str, query: Mapping[str, list[str]]) -> dict[str, Any]:
    """Deletes `model` of the key's tenant as `query` says (`force`, `reason`; the module's
    docstring); its OpenAI deletion object."""
    auth = key_authenticate(authorization, scope=ApiKey.Scope.MANAGE)
    force, reason = _delete_query(query)
    key = auth.api_key
    assert key is not None, "key_authenticate authenticates by key"
    named = job_model_parse(model)
    bases = base_model_ids()
    # As the catalog allows a job's model: also by what it stands for (a checkpoint's pinned name, the adapter).
    if not (model_allowed(key.allowed_models, model, base_model_ids=bases) or named is not None and model_allowed(
            key.allowed_models, named.pinned or named.adapter, base_model_ids=bases)):
        raise model_not_allowed(key.prefix, tuple(key.allowed_models), model)
    if model in base_model_ids():
        raise GatewayError(403, f"'{model}' is the platform's base model, which no tenant can delete; delete a "
                           "fine-tuned model of yours ('<adapter>' or '<adapter>@<version>').",
                           code="model_not_deletable", param="model")
    reason = reason or f"DELETE /v1/models/{model}"
    try:
        if named is not None:
            services.adapter_version_archive(version=_job_version(auth.tenant, model, named), actor=auth.actor,
                                             reason=reason, force=force)
        else:
            _archive(auth.tenant, model, actor=auth.actor, reason=reason, force=force)
    except NotFound:
        raise model_not_found(model) from None  # deleted meanwhile
    except ServiceError as error:
        raise _refusal(error, model) from None
    targets_forget()
    return {"id": model, "object": "model", "deleted": True}


def _archive(tenant: Tenant, model: str, *, actor: str, reason: str, force: bool) -> None:
    """Archives `<adapter>` (every version not archived yet) or `<adapter>@<version>`."""
    name, _, pinned = model.partition("@")
    adapter = Adapter.objects.filter(tenant=tenant, name=name).first()
    if adapter is None or (pinned and not SEMVER_RE.match(pinned)):
        raise model_not_found(model)
    if pinned:
        version = adapter.versions.filter(version=pinned).exclude(status=AdapterVersion.Status.ARCHIVED).first()
        if version is None:
            raise model_not_found(model)
        services.adapter_version_archive(version=version, actor=actor, reason=reason, force=force)
    elif not services.adapter_archive(adapter=adapter, actor=actor, reason=reason, force=force):
        raise model_not_found(model)  # nothing left to archive: deleted before


def _job_version(tenant: Tenant, model: str, named: JobModelName) -> AdapterVersion:
    """The registry version a job's model name stands for, as the catalog resolves it (another
    tenant's job or a name that is not the job's: the 404 of a name that never was); a kept
    checkpoint's name is refused, saying why."""
    if named.tenant is not None and named.tenant != tenant.slug:
        raise model_not_found(model)
    job = job_models().job(tenant_id=tenant.pk, job_id=named.job_id, adapter=named.adapter)
    if job is None or named.base not in (None, job.base_model):
        raise model_not_found(model)
    if named.step is not None:
        if job_models().checkpoint(job_id=job.job_id, step=named.step) is None:
            raise model_not_found(model)
        version = job.version
        instead = (f" Its job's model can be: '{named.adapter}@{version.version}'."
                   if version is not None and version.status != AdapterVersion.Status.ARCHIVED else "")
        raise GatewayError(403, f"'{model:.200}' is a checkpoint of fine-tuning job ftjob-{job.job_id}, served from the "
                           "job's kept checkpoints rather than the registry: it cannot be deleted through "
                           f"/v1/models. It stays callable while the job keeps it.{instead}",
                           code="checkpoint_not_deletable", param="model")
    version = job.version
    if version is None or version.status == AdapterVersion.Status.ARCHIVED:
        raise model_not_found(model)
    return version


def _refusal(error: ServiceError, model: str) -> GatewayError:
    """The service's refusal as the gateway's; a served model's says how to delete it anyway."""
    message = error.message
    if error.code in _SERVING_CODES:
        message += f" To delete it anyway, and stop serving it at once: DELETE /v1/models/{model}?force=true."
    return GatewayError(error.status_code, message, code=error.code, param=error.param)
