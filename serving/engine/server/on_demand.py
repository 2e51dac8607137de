"""Loading a registry version on its first request, for the gateway (the operator caller).

The gateway names a version `<tenant>/<adapter>@<version>` and sends its artifact URI and manifest
digest in the request's `loraplex_adapter` field. A worker that does not hold that name with that
digest loads it before serving the request, and refuses it if the artifact's digest differs, so
10,000 deployed versions need no worker to prefetch them all. Only a caller that presented this
worker's API key can make it read storage: on a worker without one the field is refused.
"""

from __future__ import annotations

from serving.engine import AdapterError
from serving.engine.server.adapters import AdapterSet, Source
from serving.engine.server.errors import APIError
from serving.contracts.protocol import SamplingFields
from serving.engine.server.worker import Worker


async def ensure_loaded(worker: Worker, adapters: AdapterSet, body: SamplingFields) -> None:
    """Load `body.model` from `body.loraplex_adapter` into `adapters` (the ready worker's) unless it
    is loaded with that digest."""
    ref = body.loraplex_adapter
    if ref is None:
        return
    served = adapters.get(body.model)
    if served is not None and served.info.digest == ref.manifest_sha256:
        return
    if not worker.args.api_key:
        raise APIError(403, "This worker has no API key, so it loads no adapter on request: start it with "
                       "--api-key (or $SERVING_WORKER_API_KEY) shared with the gateway.", param="loraplex_adapter",
                       code="operator_only")
    try:
        info = await adapters.load(body.model, ref.artifact_uri, load_inplace=True, source=Source.REGISTRY)
    except (AdapterError, ValueError) as exc:
        raise APIError(500, f"Adapter '{body.model}' could not be loaded from its artifact: {exc}",
                       code="adapter_load_failed") from exc
    if info.digest != ref.manifest_sha256:
        await adapters.unload(body.model)
        raise APIError(500, f"Adapter '{body.model}': the artifact's manifest sha256 is {info.digest}, the registry "
                       f"recorded {ref.manifest_sha256}; not serving it.", code="adapter_digest_mismatch")
