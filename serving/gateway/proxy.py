"""The upstream call to a serving worker, whole or streamed, and what it reports back.

The worker answers in OpenAI's shape under the internal name `<tenant>/<adapter>@<version>`; the
client must see the `model` it asked for, so that one field is rewritten in the bytes (the worker
writes compact JSON, so `"model":"<internal>"` appears exactly once per body or event) instead of
parsing and re-serialising every chunk.

Streams are passed through as they arrive, the events of one upstream read in one piece (one ASGI
send, one write to the client: the read's events are complete, so nothing waits for the next
read; the end of the stream and `[DONE]` go out with the last read's events). The gateway always asks the worker for
the final usage chunk (`stream_options.include_usage`) to charge tokens as used, and drops that
chunk unless the client asked for it too. An upstream failure mid-stream ends the client's stream
with an OpenAI-shaped error event and `[DONE]`; a client that leaves closes the upstream
connection, which makes the worker abort the request. Each call carries the request's
`X-Request-ID`, so the worker's access line names the same request as the gateway's.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import httpx

from serving.gateway.errors import error_json
from serving.gateway.failover import key_refused
from serving.wire import errors as wire_errors
from serving.wire.registry import UPSTREAM_IDLE_S
from serving.wire.request_ids import HEADER

DONE = b"data: [DONE]\n\n"
_USAGE = b'"usage":{'
_EMPTY_CHOICES = b'"choices":[]'
_ERROR_EVENT = b'data: {"error"'


@dataclass
class UpstreamResult:
    """How the upstream call went; filled while the response is relayed, final once it ends."""

    worker_id: str
    started: float = field(default_factory=time.perf_counter)
    http_status: int = 0
    # ok | client_error (the worker refused the request) | aborted (the client left) | upstream_error
    status: str = "upstream_error"
    # The worker refused the gateway's operator key (401/403): its configuration, not the client's;
    # an upstream_error for the worker's record, none for the adapter's breaker.
    key_refused: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Chunks with generated content relayed, the completion's size when no usage came (a disconnect).
    content_chunks: int = 0
    usage_known: bool = False
    first_byte_s: float | None = None
    ended_s: float | None = None
    error: str = ""
    # The `code` of the worker's own error (its refusal's body or its stream's error event), "" when
    # it sent none; serving.gateway.resilience.breaker_outcome reads it.
    error_code: str = ""
    # A refusal's whole body (error keeps its first 500 characters), relayed to the client as it came.
    refused_body: bytes = b""

    def take_usage(self, usage: dict[str, Any] | None) -> None:
        if isinstance(usage, dict):
            self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.completion_tokens = int(usage.get("completion_tokens") or 0)
            self.usage_known = True

    def refused(self, status: int, content: bytes) -> None:
        """The worker answered `status` (not 200) with `content`."""
        self.key_refused = key_refused(status)
        self.status = "client_error" if status < 500 and not self.key_refused else "upstream_error"
        self.error = content[:500].decode(errors="replace")
        self.error_code = error_code(content)
        self.refused_body = content

    def end(self) -> None:
        if self.ended_s is None:
            self.ended_s = time.perf_counter() - self.started


class Upstream:
    """One connection pool to the serving workers, authenticated with their shared API key."""

    def __init__(self, *, api_key: str, timeout_s: float, max_connections: int = 1000) -> None:
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                                keepalive_expiry=UPSTREAM_IDLE_S),
        )

    @property
    def client(self) -> httpx.AsyncClient:
        """The pool itself, for the gateway's own calls to workers (the prewarm loop)."""
        return self._client

    async def aclose(self) -> None:
        await self._client.aclose()

    def _headers_for(self, request_id: str) -> dict[str, str]:
        # The worker logs the request under the gateway's id (serving.wire.request_ids).
        return {**self._headers, HEADER: request_id}

    async def call(self, url: str, body: dict[str, Any], *, result: UpstreamResult,
                   rename: tuple[bytes, bytes], request_id: str) -> bytes:
        """A whole (non-streamed) reply's body, `model` renamed; `result` says how it went."""
        try:
            response = await self._client.post(url, json=body, headers=self._headers_for(request_id))
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            result.end()
            raise
        result.http_status = response.status_code
        result.first_byte_s = time.perf_counter() - result.started
        content = response.content
        if response.status_code == 200:
            result.status = "ok"
            try:
                result.take_usage(json.loads(content).get("usage"))
            except (ValueError, AttributeError):
                pass
            content = content.replace(*rename, 1)
        else:
            result.refused(response.status_code, content)
        result.end()
        return content

    async def open_stream(self, url: str, body: dict[str, Any], *, result: UpstreamResult,
                          request_id: str) -> httpx.Response:
        """The upstream response with its headers read, for the caller to relay; a refusal (not 200) comes
        read and closed, its body in result.refused_body."""
        request = self._client.build_request("POST", url, json=body, headers=self._headers_for(request_id))
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            result.end()
            raise
        result.http_status = response.status_code
        if response.status_code != 200:
            try:
                content = await response.aread()
            finally:
                await response.aclose()
            result.refused(response.status_code, content)
            result.end()
        return response


async def relay_stream(response: httpx.Response, *, result: UpstreamResult, rename: tuple[bytes, bytes],
                       client_wants_usage: bool) -> AsyncGenerator[bytes, None]:
    """The client's SSE events from the worker's, those of one upstream read together; closes the
    upstream however it ends."""
    buffer = b""
    done = failed = False
    out: list[bytes] = []
    try:
        async for chunk in response.aiter_raw():
            if result.first_byte_s is None:
                result.first_byte_s = time.perf_counter() - result.started
            buffer += chunk
            while (end := buffer.find(b"\n\n")) >= 0:
                event, buffer = buffer[:end + 2], buffer[end + 2:]
                if event == DONE:
                    done = True
                    continue
                if event.startswith(_ERROR_EVENT):
                    failed = True
                    result.error = event[6:506].decode(errors="replace")
                    result.error_code = error_code(event[6:])
                    out.append(event)
                    continue
                if _USAGE in event:
                    try:
                        result.take_usage(json.loads(event[6:]).get("usage"))
                    except (ValueError, AttributeError):
                        pass
                    if _EMPTY_CHOICES in event and not client_wants_usage:
                        continue
                elif b'"role":"assistant"' not in event:
                    result.content_chunks += 1
                out.append(event.replace(*rename, 1))
            if out and not done:  # once [DONE] came, the rest goes out with it
                yield b"".join(out)
                out = []
        if done:
            result.status = "upstream_error" if failed else "ok"
        else:
            result.status = "upstream_error"
            result.error = result.error or "the worker closed the stream before [DONE]"
            out.append(stream_error_event("The serving worker ended the stream early; the reply is incomplete."))
        yield b"".join([*out, DONE])
    except httpx.HTTPError as exc:
        result.status = "upstream_error"
        result.error = f"{type(exc).__name__}: {exc}"
        yield b"".join([*out, stream_error_event(
            "The connection to the serving worker failed mid-stream; the reply is incomplete."), DONE])
    except BaseException:
        # The client left (the response task is cancelled) or the server is stopping.
        if result.status != "ok":
            result.status = "aborted"
        raise
    finally:
        result.end()
        await response.aclose()


def error_code(content: bytes) -> str:
    """The `code` of an OpenAI-shaped error body (`{"error": {"code": ...}}`), "" when it has none."""
    try:
        code = json.loads(content)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return ""
    return code if isinstance(code, str) else ""


def stream_error_event(message: str, *, code: str = "upstream_error") -> bytes:
    # Mid-stream, the status (200) is sent: the event's type is that of the 502 it stands for.
    return b"data: " + error_json(message, error_type=wire_errors.error_type(502), code=code) + b"\n\n"


def rename_model(internal: str, shown: str) -> tuple[bytes, bytes]:
    """The (old, new) bytes that rename `model` in the worker's compact JSON."""
    return (b'"model":' + json.dumps(internal).encode(), b'"model":' + json.dumps(shown).encode())
