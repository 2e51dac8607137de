"""The worker's own HTTP path, warmed before it says it is ready (issue 38, "the first minute";
docs/serving-worker.md, "Warm-up: the first minute").

The engine's warm-up (serving.engine.warmup) hands the engine token ids: what only a request through
the OpenAI routes reaches stays cold, namely the body's validation, the tokenizer's first text (its
lazy set-up), the chat template's first render, the detokenizer and the stream's writer. Once the
engine is warm, ``warm_http`` sends a few such requests, text prompts to the completions and chat
routes, streamed and not, on the base and on the first adapter named at launch, through the app
itself (in-process, no socket) while the worker still answers 503 to everyone else: only a request
made in ``warm_http``'s own context (``WARMING``) is let through.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.types import ASGIApp

# True only inside warm_http: the worker admits the request although it is still loading.
WARMING: ContextVar[bool] = ContextVar("loraplex_http_warmup", default=False)

# Plain text for the prompts: about 16 tokens a sentence on Llama 3's tokenizer, under 40 on any
# the tests use; repeated up to 16 times (~256 tokens, the serve bench's prompt) as the context allows.
_SENTENCE = "The first minute after a worker starts should serve as every later minute does."
_MAX_TOKENS = 4


@dataclass(frozen=True)
class HttpWarmCall:
    """One request of the HTTP warm-up and the status it got."""

    path: str
    model: str
    stream: bool
    status: int


def http_warmup_requests(base_model: str, adapters: Sequence[str], max_model_len: int, *,
                         chat: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """The (path, body) of each request: completions unstreamed and streamed, and a streamed chat
    where the model has a chat template (``chat``; without one the route answers 400), on the base
    and on the first adapter, with a text prompt well inside ``max_model_len``."""
    text = " ".join([_SENTENCE] * max(1, min(16, max_model_len // 64)))
    requests: list[tuple[str, dict[str, Any]]] = []
    for model in (base_model, *adapters[:1]):
        common = {"model": model, "max_tokens": _MAX_TOKENS, "temperature": 0}
        requests += [
            ("/v1/completions", {**common, "prompt": text}),
            ("/v1/completions", {**common, "prompt": text, "stream": True}),
        ]
        if chat:
            requests.append(("/v1/chat/completions",
                             {**common, "messages": [{"role": "user", "content": text}], "stream": True}))
    return requests


async def warm_http(app: ASGIApp, requests: list[tuple[str, dict[str, Any]]], api_key: str | None) -> list[HttpWarmCall]:
    """Send ``requests`` one after the other through ``app`` in-process, each read to its end, as
    the operator (``api_key``); returns each one's status. A refusal (a model without a chat
    template answers 400) is a status here, not an error: the worker still starts."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    calls = []
    token = WARMING.set(True)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://warm-up",
                                     headers=headers, timeout=None) as client:
            for path, body in requests:
                async with client.stream("POST", path, json=body) as response:
                    await response.aread()
                calls.append(HttpWarmCall(path, body["model"], bool(body.get("stream")), response.status_code))
    finally:
        WARMING.reset(token)
    return calls
