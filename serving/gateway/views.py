"""The public `/v1` routes: async views that hand HTTP to serving.gateway.pipeline and back."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.views.decorators.csrf import csrf_exempt

from serving.gateway import catalog, metrics, pipeline
from serving.gateway.errors import GatewayError

_JSON = "application/json"


def _error(error: GatewayError) -> HttpResponse:
    response = HttpResponse(error.body(), status=error.status, content_type=_JSON)
    for name, value in error.headers.items():
        response[name] = value
    return response


def _reply(reply: pipeline.Reply) -> HttpResponseBase:
    if reply.stream is not None:
        response: HttpResponseBase = StreamingHttpResponse(reply.stream, status=reply.status,
                                                       content_type="text/event-stream")
    else:
        response = HttpResponse(reply.body, status=reply.status, content_type=_JSON)
    for name, value in reply.headers.items():
        response[name] = value
    return response


def _authorization(request: HttpRequest) -> str | None:
    """The request's `Authorization`; 400 when it holds several values (Django joins repeated
    headers with commas, and no key has one), as serving.gateway.asgi refuses two headers."""
    value = request.headers.get("Authorization")
    if value is not None and "," in value:
        raise GatewayError(400, "The Authorization header holds more than one value (two Authorization headers, or "
                           "a comma in one); send exactly one: 'Authorization: Bearer lp-<prefix>.<secret>'.",
                           code="duplicate_authorization")
    return value


def _completion_view(endpoint: str) -> Callable[[HttpRequest], Coroutine[Any, Any, HttpResponseBase]]:
    @csrf_exempt
    async def view(request: HttpRequest) -> HttpResponseBase:
        if request.method != "POST":
            return _error(GatewayError(405, f"Use POST for {request.path}.", code="method_not_allowed"))
        try:
            reply = await pipeline.handle(endpoint, authorization=_authorization(request), raw_body=request.body)
        except GatewayError as error:
            return _error(error)
        return _reply(reply)

    view.__name__ = f"{endpoint}_completions"
    return view


chat_completions = _completion_view("chat")
completions = _completion_view("completions")


def _card(entry: catalog.ModelEntry) -> dict:
    return {"id": entry.id, "object": "model", "created": entry.created, "owned_by": entry.owned_by,
            "root": entry.root, "parent": entry.parent}


async def models(request: HttpRequest) -> HttpResponse:
    """`GET /v1/models`: the base model and the caller's deployed adapters, nothing of others."""
    try:
        caller = await catalog.caller_for(_authorization(request))
    except GatewayError as error:
        return _error(error)
    entries = await sync_to_async(catalog.model_list)(caller)
    return HttpResponse(json.dumps({"object": "list", "data": [_card(entry) for entry in entries]}),
                        content_type=_JSON)


async def model_detail(request: HttpRequest, model: str) -> HttpResponse:
    """`GET /v1/models/{id}`: one model the caller may request; the same 404 for others' names."""
    try:
        caller = await catalog.caller_for(_authorization(request))
        entry = await sync_to_async(catalog.model_get)(caller, model)
    except GatewayError as error:
        return _error(error)
    return HttpResponse(json.dumps(_card(entry)), content_type=_JSON)


async def metrics_view(request: HttpRequest) -> HttpResponse:
    """`GET /metrics`: the gateway's Prometheus metrics (all web processes' in multiprocess mode)."""
    body, content_type = metrics.render()
    return HttpResponse(body, content_type=content_type)
