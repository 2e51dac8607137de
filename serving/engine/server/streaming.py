"""Server-sent events in OpenAI's framing: `data: <json>\\n\\n` per chunk and `data: [DONE]` last.

A stream that fails after it started cannot change its status any more; it sends the error as one
`data: {"error": …}` event before `[DONE]`, as vLLM does, so clients see why it stopped (an
`APIError` with its own status and code, e.g. `adapter_slot_corrupted`; anything else as a 500).
Whatever ends a stream by an exception is logged (WARNING or above) with the request id, so a
client's cut-off stream can be matched to the worker's log.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from json.encoder import encode_basestring
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


class SseTemplate:
    """``sse(payload)`` for a run of payloads that differ only in one string field and, optionally,
    one list of ints: rendered once with markers, then each event splices the values in. A stream
    sends one event per token, and pydantic's build, validation and dump of the nested response
    was the largest share of the event loop's per-token work; this writes the same bytes.

    ``payload`` carries ``TEXT_MARK`` in the string field ``text_key`` and ``IDS_MARK`` in the
    list field ``ids_key`` (None: no such field)."""

    TEXT_MARK = "@@text@@"
    IDS_MARK = [-1]

    def __init__(self, payload: BaseModel, text_key: str, ids_key: str | None = None) -> None:
        rendered = payload.model_dump_json().translate(_LINE_BREAKS)
        # A key in quotes then a colon occurs only outside strings (quotes in strings are escaped).
        head, found, rest = rendered.partition(f'"{text_key}":"{self.TEXT_MARK}"')
        if not found:
            raise ValueError(f"the payload has no {text_key!r} field holding the text marker")
        self._head = f'data: {head}"{text_key}":'.encode()
        self._mid, self._tail = rest.encode(), b""
        self._ids_key = ids_key
        if ids_key is not None:
            mid, found, tail = rest.partition(f'"{ids_key}":[-1]')
            if not found:
                raise ValueError(f"the payload has no {ids_key!r} field holding the ids marker")
            self._mid, self._tail = f'{mid}"{ids_key}":['.encode(), f"]{tail}".encode()
        self._tail += b"\n\n"

    def render(self, text: str, token_ids: list[int] | None = None) -> bytes:
        # json.dumps(text, ensure_ascii=False) escapes a string as pydantic's JSON does; this is
        # its escaping function without the encoder it builds per call (13 x faster), and ASCII
        # text holds none of the line breaks to escape.
        quoted = encode_basestring(text)
        encoded = (quoted if quoted.isascii() else quoted.translate(_LINE_BREAKS)).encode()
        if self._ids_key is None:
            return b"".join((self._head, encoded, self._mid, self._tail))
        ids = ",".join(map(str, token_ids or ())).encode()
        return b"".join((self._head, encoded, self._mid, ids, self._tail))


async def guarded(chunks: AsyncIterator[bytes], request_id: str) -> AsyncIterator[bytes]:
    """The chunks, then `[DONE]`; an error becomes an error event first."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as exc:  # an error the worker names (a stopped request): its status and code
        log.warning("stream %s ended with an error: %s", request_id, exc.message)
        yield sse(error_body(exc.status, exc.message, param=exc.param, code=exc.code))
    except Exception as exc:
        log.exception("stream %s failed", request_id)
        yield sse(error_body(500, f"The stream failed: {exc}"))
    yield DONE


class GenerationStream(StreamingResponse):
    """An SSE response that closes its generation however the response ends.

    Starlette cancels a streaming response when the client disconnects; the body iterator may then
    be left suspended and only finalised later. Closing here (it does not wait) aborts the engine
    request at once."""

    def __init__(self, chunks: AsyncIterator[bytes], generation: Generation) -> None:
        super().__init__(
            guarded(chunks, generation.request_id),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except Exception as exc:
            # Past the headers, an exception here (a send that failed, the client gone) can only
            # close the connection: the client sees it cut mid-stream, so the log must say which.
            log.warning("stream %s cut off by %r", self._generation.request_id, exc)
            raise
        finally:
            await self._generation.aclose()
