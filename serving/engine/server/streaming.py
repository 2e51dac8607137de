"""Server-sent events in OpenAI's framing: `data: <json>\\n\\n` per chunk and `data: [DONE]` last.

A stream that fails after it started cannot change its status any more; it sends the error as one
`data: {"error": …}` event before `[DONE]`, as vLLM does, so clients see why it stopped (an
`APIError` with its own status and code, e.g. `adapter_slot_corrupted`; anything else as a 500).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from serving.engine.server.errors import APIError, error_body
from serving.engine.server.generation import Generation

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
# JSON leaves these unescaped, yet line readers that follow str.splitlines() (httpx's
# iter_lines, for one) break lines at them: escaped, an event is always one line for every client.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: BaseModel | dict[str, Any]) -> bytes:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data.translate(_LINE_BREAKS)}\n\n".encode()


async def guarded(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The chunks, then `[DONE]`; an error becomes an error event first."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as exc:  # an error the worker names (a stopped request): its status and code
        log.warning("stream ended with an error: %s", exc.message)
        yield sse(error_body(exc.status, exc.message, param=exc.param, code=exc.code))
    except Exception as exc:
        log.exception("stream failed")
        yield sse(error_body(500, f"The stream failed: {exc}"))
    yield DONE


class GenerationStream(StreamingResponse):
    """An SSE response that closes its generation however the response ends.

    Starlette cancels a streaming response when the client disconnects; the body iterator may then
    be left suspended and only finalised later. Closing here (it does not wait) aborts the engine
    request at once."""

    def __init__(self, chunks: AsyncIterator[bytes], generation: Generation) -> None:
        super().__init__(
            guarded(chunks),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._generation.aclose()
