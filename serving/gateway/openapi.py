"""The gateway's routes in the OpenAPI schema (`/api/schema/`): a drf-spectacular postprocessing hook
(SPECTACULAR_SETTINGS["POSTPROCESSING_HOOKS"]).

`/v1/chat/completions` and `/v1/completions` are ASGI routes (serving.gateway.asgi) and the
`/v1/models` views plain Django ones, so drf-spectacular, which reads DRF views, never sees them.
This hook adds them to the generated schema with their request and response bodies, taken from the
worker's pydantic models (serving.contracts.protocol: what the gateway forwards and relays is
what the worker reads and answers), so the schema follows those models as they change. Pydantic
writes JSON Schema 2020-12; the schema is OpenAPI 3.0, so `_oas30` rewrites what 3.0 spells
otherwise (`nullable`, `enum` for `const`, boolean `exclusiveMinimum`), and the models' `$defs`
become components. The errors are api.schema's error body.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from serving.contracts.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from serving.gateway.model_delete import REASON_MAX_CHARS

_REF = "#/components/schemas/{model}"
_ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
_ERRORS = {
    400: "Invalid request: a field or parameter is wrong (`error.param` names it); the worker's refusals too "
         "(e.g. `context_length_exceeded`).",
    401: "No API key, or one that is unknown, revoked or expired (`invalid_api_key`, `key_expired`).",
    403: "The key lacks the scope (`insufficient_scope`), the model is outside its allow-list "
         "(`model_not_allowed`), or the tenant is suspended (`tenant_suspended`).",
    404: "No such model for this key's tenant (`model_not_found`; another tenant's model is as missing as one "
         "that never was), or an adapter with no active version (`model_not_deployed`).",
    409: "The model is served (`adapter_serving`, `version_serving`): delete with `force=true` to stop serving it.",
    413: "The request body is over its limit (`payload_too_large`).",
    429: "Over the tier's or the key's rate limits or the key's monthly budget (`rate_limit_exceeded`, "
         "`key_budget_exceeded`); `retry-after` says when.",
    502: "The serving worker failed or could not be reached (`upstream_unavailable`).",
    503: "No serving worker can take the request now (`no_serving_worker`, `overloaded`); retry.",
}
_MODEL_PATH_PARAMETER = {"in": "path", "name": "model", "required": True, "schema": {"type": "string"},
                         "description": "A model id: the base model, `<adapter>` or `<adapter>@<version>`."}
MODEL_DELETED = {
    "type": "object", "required": ["id", "object", "deleted"], "additionalProperties": False,
    "properties": {"id": {"type": "string"}, "object": {"type": "string", "enum": ["model"]},
                   "deleted": {"type": "boolean"}},
}


def _oas30(node: Any) -> Any:
    """A JSON Schema 2020-12 fragment (pydantic's) as OpenAPI 3.0 writes it."""
    if isinstance(node, list):
        return [_oas30(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _oas30(value) for key, value in node.items() if key != "$defs"}
    if "const" in out:
        out["enum"] = [out.pop("const")]
    if isinstance(out.get("exclusiveMinimum"), (int, float)) and not isinstance(out["exclusiveMinimum"], bool):
        out["minimum"], out["exclusiveMinimum"] = out["exclusiveMinimum"], True
    if isinstance(out.get("exclusiveMaximum"), (int, float)) and not isinstance(out["exclusiveMaximum"], bool):
        out["maximum"], out["exclusiveMaximum"] = out["exclusiveMaximum"], True
    if "examples" in out:
        examples = out.pop("examples")
        if isinstance(examples, list) and examples:
            out["example"] = examples[0]
    options = out.get("anyOf")
    if isinstance(options, list) and {"type": "null"} in options:
        rest = [option for option in options if option != {"type": "null"}]
        del out["anyOf"]
        if len(rest) == 1 and "$ref" not in rest[0]:
            out = {**rest[0], **out}
        elif len(rest) == 1:
            out["allOf"] = rest  # a $ref takes no sibling keys in 3.0
        else:
            out["anyOf"] = rest
        out["nullable"] = True
    return out


def _component(components: dict[str, Any], model: type[BaseModel], mode: str) -> dict[str, str]:
    """`model` (and the models it uses) among the components; a reference to it."""
    schema = model.model_json_schema(ref_template=_REF, mode=mode)  # type: ignore[arg-type]
    for name, definition in {**schema.get("$defs", {}), model.__name__: schema}.items():
        converted = _oas30(definition)
        if components.setdefault(name, converted) != converted:
            raise ValueError(f"The OpenAPI component '{name}' means two things: the gateway's model "
                             f"({model.__module__}) and another; rename one.")
    return {"$ref": _REF.format(model=model.__name__)}


def _responses(ok: dict[str, Any], description: str, errors: tuple[int, ...]) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": description, "content": ok}}
    for status in errors:
        responses[str(status)] = {"description": _ERRORS[status], "content": _ERROR}
    return responses


def _completion_route(components: dict[str, Any], *, operation: str, summary: str, request: type[BaseModel],
                      response: type[BaseModel], chunk: type[BaseModel]) -> dict[str, Any]:
    # OpenAPI 3.0 cannot type the events of a stream: the description names their component.
    _component(components, chunk, "serialization")
    stream = {"type": "string", "description": f"With `stream: true`: server-sent events, each "
              f"`data: <{chunk.__name__} JSON>`, then `data: [DONE]`; a failure mid-stream is a `data:` event "
              "with the error body."}
    return {"post": {
        "operationId": operation, "summary": summary, "tags": ["v1"], "security": [{"apiKey": []}],
        "description": "OpenAI's endpoint, served by the gateway: `model` is the base model, `<adapter>` (its active "
                       "version, and its canary by weight) or `<adapter>@<version>`. Fields the worker cannot "
                       "honour are refused with a 400 naming them (docs/gateway.md).",
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _component(components, request, "validation")}}},
        "responses": _responses({"application/json": {"schema": _component(components, response, "serialization")},
                                 "text/event-stream": {"schema": stream}},
                                "The completion, or its stream.", (400, 401, 403, 404, 413, 429, 502, 503)),
    }}


def gateway_paths(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular's postprocessing hook: the schema with the gateway's routes."""
    components = result.setdefault("components", {}).setdefault("schemas", {})
    security: list[dict[str, list[str]]] = [{"apiKey": []}]
    card = {"application/json": {"schema": _component(components, ModelCard, "serialization")}}
    paths = {
        "/v1/chat/completions": _completion_route(
            components, operation="gateway_chat_completions_create", summary="OpenAI: a chat completion",
            request=ChatCompletionRequest, response=ChatCompletionResponse, chunk=ChatCompletionChunk),
        "/v1/completions": _completion_route(
            components, operation="gateway_completions_create", summary="OpenAI: a text completion",
            request=CompletionRequest, response=CompletionResponse, chunk=CompletionResponse),
        "/v1/models": {"get": {
            "operationId": "gateway_models_list", "summary": "OpenAI: the models this key may call",
            "description": "The base model and the tenant's deployed adapters (each by name, and each served "
                           "version pinned); nothing of other tenants.", "tags": ["v1"], "security": security,
            "responses": _responses({"application/json": {"schema": _component(components, ModelList,
                                                                                  "serialization")}},
                                    "The model list.", (401, 403)),
        }},
        "/v1/models/{model}": {
            "get": {"operationId": "gateway_models_retrieve", "summary": "OpenAI: one model",
                    "tags": ["v1"], "security": security, "parameters": [_MODEL_PATH_PARAMETER],
                    "responses": _responses(card, "The model.", (401, 403, 404, 429))},
            "delete": {
                "operationId": "gateway_models_delete", "summary": "OpenAI: delete a fine-tuned model",
                "description": "Archives the adapter's versions (`<adapter>`) or one version (`<adapter>@<version>`) "
                               "through the registry, audited with the key and `reason`. Needs the `manage` scope; "
                               "the base model cannot be deleted (403 `model_not_deletable`).",
                "tags": ["v1"], "security": security,
                "parameters": [
                    _MODEL_PATH_PARAMETER,
                    {"in": "query", "name": "force", "required": False, "schema": {"type": "boolean", "default": False},
                     "description": "Delete a served model too, stopping its serving at once (else 409)."},
                    {"in": "query", "name": "reason", "required": False,
                     "schema": {"type": "string", "maxLength": REASON_MAX_CHARS},
                     "description": "The audit log's reason (default: the request)."},
                ],
                "responses": _responses({"application/json": {"schema": MODEL_DELETED}}, "The model is deleted.",
                                        (400, 401, 403, 404, 409)),
            },
        },
    }
    result.setdefault("paths", {}).update(paths)
    return result
