"""The public `/v1` routes Django serves: the model list, one model (and its deletion), `/metrics`
(thin async views over serving.gateway.catalog and serving.gateway.model_delete). The completion
routes are the ASGI fast path's (serving.gateway.asgi)."""

from __future__ import annotations

import json

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

from serving.gateway import catalog, metrics, pipeline, wiring
from serving.gateway.errors import GatewayError
from serving.gateway.model_delete import model_delete

_JSON = "application/json"


def _error(error: GatewayError) -> HttpResponse:
    response = HttpResponse(error.body(), status=error.status, content_type=_JSON)
    for name, value in error.headers.items():
        response[name] = value
    return response


def _method_refusal(request: HttpRequest, allowed: tuple[str, ...]) -> HttpResponse | None:
    """405 naming the methods `allowed`, for a method outside them; None otherwise."""
    if request.method in allowed:
        return None
    return _error(GatewayError(405, f"Method {request.method} is not allowed on {request.path}; use "
                               f"{' or '.join(allowed)}.", code="method_not_allowed",
                               headers={"Allow": ", ".join(allowed)}))


def _authorization(request: HttpRequest) -> str | None:
    """The request's `Authorization`; 400 when it holds several values (Django joins repeated
    headers with commas, and no key has one), as serving.gateway.asgi refuses two headers."""
    value = request.headers.get("Authorization")
    if value is not None and "," in value:
        raise GatewayError(400, "The Authorization header holds more than one value (two Authorization headers, or "
                           "a comma in one); send exactly one: 'Authorization: Bearer lp-<prefix>.<secret>'.",
                           code="duplicate_authorization")
    return value


@csrf_exempt
def completions_elsewhere(request: HttpRequest) -> HttpResponse:
    """`/v1/chat/completions` and `/v1/completions` under Django's own handler (WSGI, Django's test
    client): their one entry point is the ASGI application (serving.gateway.asgi), so this says so
    rather than answering as if the route did not exist."""
    return _error(GatewayError(
        404, f"{request.path} is served by the web process's ASGI application (lora_platform.asgi:application, "
             "under uvicorn), not by Django's own request handler; send the request to the ASGI server.",
        code="endpoint_not_served"))


def _card(entry: catalog.ModelEntry) -> dict:
    return {"id": entry.id, "object": "model", "created": entry.created, "owned_by": entry.owned_by,
            "root": entry.root, "parent": entry.parent}


@csrf_exempt
async def models(request: HttpRequest) -> HttpResponse:
    """`GET /v1/models`: the base model and the caller's deployed adapters, nothing of others."""
    refusal = _method_refusal(request, ("GET",))
    if refusal is not None:
        return refusal
    try:
        caller = await catalog.caller_for(_authorization(request))
    except GatewayError as error:
        return _error(error)
    entries = await sync_to_async(catalog.model_list)(caller)
    return HttpResponse(json.dumps({"object": "list", "data": [_card(entry) for entry in entries]}),
                        content_type=_JSON)


@csrf_exempt
async def model_detail(request: HttpRequest, model: str) -> HttpResponse:
    """`GET /v1/models/{id}`: one model the caller may request; the same 404 for others' names, which
    costs one request from the caller's bucket as a completion's would (serving.gateway.pipeline.charged_refusal).
    `DELETE`: deletes a fine-tuned model of the caller's (serving.gateway.model_delete)."""
    refusal = _method_refusal(request, ("GET", "DELETE"))
    if refusal is not None:
        return refusal
    if request.method == "DELETE":
        return await _model_delete(request, model)
    try:
        caller = await catalog.caller_for(_authorization(request))
    except GatewayError as error:
        return _error(error)
    try:
        entry = await sync_to_async(catalog.model_get)(caller, model)
    except GatewayError as error:
        if error.status == 404 or error.code == "model_not_allowed":
            # As in a completion: probing names costs a request from the caller's bucket (429 once empty).
            return _error(await pipeline.charged_refusal(caller, "models", error, wiring.resources()))
        return _error(error)
    return HttpResponse(json.dumps(_card(entry)), content_type=_JSON)


async def _model_delete(request: HttpRequest, model: str) -> HttpResponse:
    try:
        authorization = _authorization(request)
        deleted = await sync_to_async(model_delete)(authorization, model, dict(request.GET.lists()))
    except GatewayError as error:
        return _error(error)
    return HttpResponse(json.dumps(deleted), content_type=_JSON)


async def metrics_view(request: HttpRequest) -> HttpResponse:
    """`GET /metrics`: the gateway's Prometheus metrics (all web processes' in multiprocess mode)."""
    body, content_type = metrics.render()
    return HttpResponse(body, content_type=content_type)
