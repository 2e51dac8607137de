"""The request a serving worker gets for a call: the caller's allowed fields (request_fields),
the internal model name and the version's artifact, the effective max_tokens, the tier's priority
and the tenant's prefix-cache salt."""

from __future__ import annotations

from typing import Any

from serving.gateway.records import Call
from serving.gateway.request_fields import forwarded, requested_max_tokens
from serving.gateway.routing import WorkerView

# Degraded requests run after every tier's own (the engine serves lower values first).
DEGRADED_PRIORITY = 10


def upstream_body(call: Call, worker: WorkerView) -> dict[str, Any]:
    """The worker's request: the internal name, the version's artifact (so a worker that does not
    hold it loads it, verified by digest), the tier's priority, the effective max_tokens and the
    tenant's prefix-cache salt."""
    body = forwarded(call.body, call.endpoint)
    if call.version is not None:
        body["model"] = call.version.qualified_name
        body["loraplex_adapter"] = {"artifact_uri": call.version.artifact_uri,
                                    "manifest_sha256": call.version.manifest_sha256}
    else:
        body["model"] = worker.base_model
    max_tokens = call.max_tokens
    context = worker.max_model_len
    if requested_max_tokens(call.body, call.endpoint) is None and context:
        # The tier's limit, bounded by what the context leaves after the (estimated) prompt.
        max_tokens = max(1, min(max_tokens, context - call.prompt_estimate))
    body["max_tokens"] = max_tokens
    body["priority"] = DEGRADED_PRIORITY if call.degraded else call.caller.tier.priority
    # The worker shares cached prompt blocks only between requests of one salt: without it two
    # tenants' identical base-model prompts would share KV, and one could time the other's prompts
    # (a caller's own cache_salt is not forwarded: tenants cannot pick another's).
    body["cache_salt"] = f"tenant-{call.caller.tenant_id}"
    if body.get("stream"):
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True
        body["stream_options"] = options
    return body
