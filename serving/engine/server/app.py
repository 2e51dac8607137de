"""The HTTP routes of the serving worker (vLLM's OpenAI-compatible server, route for route)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from serving.engine import AdapterError, AdapterNotFoundError
from serving.engine.server.adapter_roots import AdapterLocationRefused
from serving.engine.server.adapters import Source
from serving.engine.server.auth import OperatorAuth, is_operator
from serving.engine.server.body_json import CheckedJSONRoute
from serving.engine.server.body_limit import BodyLimit
from serving.engine.server.chat import create_chat_completion
from serving.engine.server.completions import create_completion
from serving.engine.server.errors import APIError, bad_request, install_error_handlers
from serving.engine.server.generation import ClientDisconnected
from serving.engine.server.http_warmup import HttpWarmCall, http_warmup_requests, warm_http
from serving.engine.server.metrics import CONTENT_TYPE
from serving.engine.server.prefetch import PrefetchItem, Prefetcher
from serving.contracts.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    PrefetchLoRAAdaptersRequest,
    UnloadLoRAAdapterRequest,
)
from serving.engine.server.worker import State, Worker
from serving.contracts.names import in_registry_form

# nginx's code for "the client closed the request": nobody reads it, the access log does.
_CLIENT_CLOSED = 499


def readiness(worker: Worker) -> dict[str, dict[str, Any]]:
    """The worker's readiness checks for /readyz: the engine, and the registry's adapters."""
    engine: dict[str, Any]
    if worker.state is not State.READY:
        engine = {"ok": False, "error": worker.engine_failure or f"the worker is {worker.state.value}"}
    elif worker.engine is None or not worker.engine.is_running:
        engine = {"ok": False, "error": "the engine's loop has stopped"}
    else:
        engine = {"ok": True, "detail": "running"}
    if not worker.args.registry_url:
        return {"engine": engine, "adapters": {"ok": True, "detail": "no --registry-url: nothing to sync"}}
    stats = worker.sync.stats if worker.sync is not None else None
    adapters: dict[str, Any]
    if stats is not None and stats.snapshots > 0:
        adapters = {"ok": True, "detail": f"registry revision {stats.revision} applied"
                    + (f"; {stats.load_failures} load failure(s) so far" if stats.load_failures else "")}
    else:
        failures = stats.snapshot_failures if stats is not None else 0
        adapters = {"ok": False, "error": "the registry's snapshot has not been applied yet"
                    + (f" ({failures} failed attempt(s); see the log)" if failures else "")}
    return {"engine": engine, "adapters": adapters}


def build_app(worker: Worker) -> FastAPI:
    prefetcher = Prefetcher()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await worker.start()
        yield
        await prefetcher.close()
        await worker.stop()

    app = FastAPI(title="Loraplex serving worker", lifespan=lifespan, docs_url=None, redoc_url=None)
    if worker.warms_up:

        async def http_warmup() -> list[HttpWarmCall]:
            """Text through this app's own routes once the engine is warm (the worker still loading)."""
            assert worker.engine is not None  # the worker calls it once its engine has warmed up
            requests = http_warmup_requests(worker.base_model_id, [module.name for module in worker.args.lora_modules],
                                            worker.engine.max_model_len,
                                            chat=bool(worker.engine.tokenizer.chat_template))
            return await warm_http(app, requests, worker.args.api_key)

        worker.http_warmup = http_warmup
    app.router.route_class = CheckedJSONRoute  # bodies within serving.contracts.request_caps' bounds
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=_CLIENT_CLOSED)

    # Outermost first: the key is checked before a byte of the body is read, then the body's size.
    app.add_middleware(BodyLimit, max_bytes=worker.args.max_request_body_bytes)
    app.add_middleware(OperatorAuth, api_key=worker.args.api_key)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 once the model is loaded and the worker takes requests; 503 before and while draining.
        Kept for existing callers; probes use /healthz and /readyz."""
        ready = worker.state is State.READY
        return JSONResponse({"status": worker.state.value}, status_code=200 if ready else 503)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        """Alive: the process's event loop answers, whatever the worker's state (loading and draining too)."""
        return JSONResponse({"status": "alive", "state": worker.state.value})

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        """200 when the engine runs and takes requests and the registry's versions are loaded (the first
        snapshot applied); 503 naming what is not. Without --registry-url there is nothing to sync."""
        checks = readiness(worker)
        failing = [name for name, check in checks.items() if not check["ok"]]
        return JSONResponse({"status": "not_ready" if failing else "ready", "failing": failing, "checks": checks},
                            status_code=503 if failing else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        sync = worker.sync.stats if worker.sync is not None else None
        return Response(worker.metrics.render(await worker.stats(), sync), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        """`root` is where a model was loaded from for the operator; others see the model's id, as
        storage paths and bucket names are nobody else's business."""
        engine, adapters = worker.require_ready()
        operator = is_operator(request)
        created = int(worker.started_at)
        cards = [
            ModelCard(id=name, created=created, root=worker.args.model if operator else name,
                      max_model_len=engine.max_model_len)
            for name in worker.base_model_ids
        ]
        cards += [
            ModelCard(id=name, created=created, root=served.info.path if operator else name,
                      parent=worker.base_model_id)
            for name, served in sorted(adapters.all().items())
        ]
        return ModelList(data=cards)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request, worker)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, request, worker)

    def _registry_names_are_the_operators(request: Request, name: str) -> None:
        if in_registry_form(name) and not is_operator(request):
            raise APIError(
                409,
                f"'{name}' has the registry's name form <tenant>/<adapter>@<version>: those names are loaded and "
                "unloaded by the registry only. Choose a name without '/' and '@'.",
                param="lora_name", code="registry_name",
            )

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> dict[str, Any]:
        """Load into the CPU cache (a GPU slot is filled on first use); other requests keep running.
        Same name, same content: 200. Same name, other content: 400 unless `load_inplace`.
        A registry-form name: 409 unless the operator asks."""
        _, adapters = worker.require_ready()
        _registry_names_are_the_operators(request, body.lora_name)
        try:
            info = await adapters.load(body.lora_name, body.lora_path, load_inplace=body.load_inplace, source=Source.API)
        except AdapterLocationRefused as exc:
            raise APIError(400, f"Cannot load adapter '{body.lora_name}': {exc}", param="lora_path",
                           code="lora_path_not_allowed") from exc
        except (AdapterError, ValueError) as exc:
            raise bad_request(f"Cannot load adapter '{body.lora_name}': {exc}", param="lora_path") from exc
        if in_registry_form(body.lora_name) and worker.sync is not None:
            # The operator changed a name the registry owns: the registry's record wins at once.
            worker.sync.reconcile_soon()
        return {
            "lora_name": info.name,
            "lora_path": body.lora_path,
            "digest": info.digest,
            "rank": info.rank,
            "lora_alpha": info.lora_alpha,
            "target_modules": list(info.target_modules),
            "kind": info.kind,
            "load_seconds": info.load_seconds,
        }

    @app.post("/v1/verify_lora_slots")
    async def verify_lora_slots() -> dict[str, Any]:
        """Check every GPU slot's checksum now (as the periodic check does): each slot whose content
        changed since it was written is reloaded from storage and listed, with the number of requests
        stopped because they had produced tokens from it; on registry versions it counts as a
        circuit-breaker failure. Behind the worker's key like every /v1 route."""
        worker.require_ready()
        assert worker.slot_guard is not None  # set before the worker is ready
        repairs = await worker.slot_guard.verify()
        return {"repaired": [{"slot": r.slot, "digest": r.digest, "names": list(r.names), "stopped": r.stopped}
                             for r in repairs]}

    @app.post("/v1/prefetch_lora_adapters")
    async def prefetch_lora_adapters(body: PrefetchLoRAAdaptersRequest, request: Request) -> dict[str, Any]:
        """The operator's (the gateway's prewarm loop): load registry versions into the CPU cache
        and, where `to_gpu`, a free or idle GPU slot, ahead of their traffic (server.prefetch); it
        answers once the slot placements are done, the CPU-only ones `queued`."""
        engine, adapters = worker.require_ready()
        if not is_operator(request):
            raise APIError(403, "Prefetching reads storage and fills GPU slots: only the operator may, with this "
                           "worker's --api-key (a worker without a key has no operator).", code="operator_only")
        items = [PrefetchItem(name=entry.lora_name, artifact_uri=entry.artifact_uri,
                              manifest_sha256=entry.manifest_sha256, to_gpu=entry.to_gpu) for entry in body.adapters]
        for item in items:
            if not in_registry_form(item.name):
                raise APIError(400, f"'{item.name}' is not a registry version name (<tenant>/<adapter>@<version>); "
                               "prefetch serves the registry's versions only.", param="adapters", code="not_registry_name")
        results = await prefetcher.prefetch(engine, adapters, items)
        return {"data": [{"lora_name": r.name, "cpu": r.cpu, "gpu": r.gpu, "queued": r.queued, "error": r.error}
                         for r in results]}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> dict[str, Any]:
        """Unload; the slot and CPU copy are freed once the adapter's in-flight requests finish.
        A registry-form name: 409 unless the operator asks."""
        _, adapters = worker.require_ready()
        _registry_names_are_the_operators(request, body.lora_name)
        try:
            await adapters.unload(body.lora_name)
        except AdapterNotFoundError as exc:
            raise APIError(404, f"No adapter named '{body.lora_name}' is loaded.", param="lora_name", code="model_not_found") from exc
        return {"lora_name": body.lora_name, "unloaded": True}

    return app
