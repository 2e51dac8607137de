"""The upstream call to a serving worker, whole or streamed, and what it reports back.

The worker answers in OpenAI's shape under the internal name `<tenant>/<adapter>@<version>`; the
client must see the `model` it asked for, so that one field is rewritten in the bytes (the worker
writes compact JSON, so `"model":"<internal>"` appears exactly once per body or event) instead of
parsing and re-serialising every chunk.

Replies are read with the gateway's own HTTP/1.1 client (serving.gateway.stream_http: httpx's
streaming iterator cost more CPU per token than the rest of the relay), and streams are passed
through as they arrive, the events of one upstream read in one piece (one ASGI send, one write to
the client: the read's events are complete, so nothing waits for the next read; the end of the
stream and `[DONE]` go out with the last read's events). The gateway always asks the worker for
the final usage chunk (`stream_options.include_usage`) to charge tokens as used, and drops that
chunk unless the client asked for it too. An upstream failure mid-stream ends the client's stream
with an OpenAI-shaped error event and `[DONE]`; a client that leaves closes the upstream
connection, which makes the worker abort the request. Each call carries the request's
`X-Request-ID`, so the worker's access line names the same request as the gateway's.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from serving.gateway.errors import error_json, invalid_request
from serving.gateway.failover import key_refused
from serving.gateway.stream_http import StreamPool, StreamResponse
from serving.contracts import errors as wire_errors
from serving.contracts.registry import UPSTREAM_IDLE_S
from serving.contracts.request_ids import HEADER

DONE = b"data: [DONE]\n\n"
_USAGE = b'"usage":{'
_EMPTY_CHOICES = b'"choices":[]'
_ERROR_EVENT = b'data: {"error"'
_ROLE = b'"role":"assistant"'


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
    # The gateway itself failed the call (a request it could not encode, a bug of its own): whatever
    # the status says, neither the worker's nor the adapter's doing (serving.gateway.resilience).
    gateway_fault: bool = False

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


class StreamBody(Protocol):
    """A streamed reply's body as the relay reads it (serving.gateway.stream_http.StreamResponse)."""

    async def read(self) -> bytes: ...

    async def aclose(self) -> None: ...


class Upstream:
    """The connections to the serving workers, authenticated with their shared API key: the
    gateway's own client for the calls it relays (serving.gateway.stream_http), httpx's pool for its
    own calls (the prewarm loop)."""

    def __init__(self, *, api_key: str, timeout_s: float, first_byte_timeout_s: float | None = None,
                 max_connections: int = 1000) -> None:
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # A streamed call's bound on the worker's response head (its first token); None: the read timeout.
        self._first_byte_timeout_s = first_byte_timeout_s
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                                keepalive_expiry=UPSTREAM_IDLE_S),
        )
        self._relayed = StreamPool(read_timeout_s=timeout_s, connect_timeout_s=5.0, idle_s=UPSTREAM_IDLE_S,
                                   max_connections=max_connections)

    @property
    def client(self) -> httpx.AsyncClient:
        """httpx's pool, for the gateway's own calls to workers (the prewarm loop)."""
        return self._client

    async def aclose(self) -> None:
        await self._relayed.aclose()
        await self._client.aclose()

    async def _post(self, url: str, body: dict[str, Any], result: UpstreamResult, request_id: str, *,
                    head_timeout_s: float | None = None) -> StreamResponse:
        # httpx's JSON encoding, byte for byte; the worker logs the request under the gateway's id
        # (serving.contracts.request_ids).
        try:
            payload = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
        except (ValueError, UnicodeEncodeError) as exc:
            # NaN, Infinity or a lone surrogate that got past the request's checks: the caller's, a 400.
            result.status, result.http_status, result.gateway_fault = "client_error", 400, True
            result.end()
            raise invalid_request(f"The request holds a value JSON cannot carry to the worker ({exc}); send finite "
                                  "numbers and valid Unicode.", code="invalid_json") from None
        try:
            response = await self._relayed.post(url, payload, {**self._headers, HEADER: request_id},
                                                head_timeout_s=head_timeout_s)
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            result.end()
            raise
        result.http_status = response.status_code
        return response

    async def call(self, url: str, body: dict[str, Any], *, result: UpstreamResult,
                   rename: tuple[bytes, bytes], request_id: str) -> bytes:
        """A whole (non-streamed) reply's body, `model` renamed; `result` says how it went."""
        response = await self._post(url, body, result, request_id)
        result.first_byte_s = time.perf_counter() - result.started
        try:
            content = await response.aread()
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            result.end()
            raise
        finally:
            await response.aclose()
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
                          request_id: str) -> StreamResponse:
        """The upstream response with its headers read, for the caller to relay; a refusal (not 200) comes
        read and closed, its body in result.refused_body. The worker sends a stream's headers with
        its first token: without them within the first-byte bound, FirstByteTimeout (the pipeline
        fails over). A whole reply's headers come with its last token, so only the read timeout
        bounds those."""
        response = await self._post(url, body, result, request_id, head_timeout_s=self._first_byte_timeout_s)
        if response.status_code != 200:
            try:
                content = await response.aread()
            finally:
                await response.aclose()
            result.refused(response.status_code, content)
            result.end()
        return response


class Relay:
    """relay_stream's events, ended however the reply ends: also when the client leaves before the
    first event is read. An async generator closed before it starts runs none of its body, so its
    `finally` would neither close the upstream nor settle the call (the key budget's reservation
    would lapse only after its hour)."""

    def __init__(self, response: StreamBody, *, result: UpstreamResult, rename: tuple[bytes, bytes],
                 client_wants_usage: bool, on_end: Callable[[], None] | None = None) -> None:
        self._response, self._result, self._on_end = response, result, on_end
        self._events = relay_stream(response, result=result, rename=rename, client_wants_usage=client_wants_usage,
                                    on_end=on_end)
        self._started = False

    def __aiter__(self) -> Relay:
        return self

    async def __anext__(self) -> bytes:
        self._started = True
        return await self._events.__anext__()

    async def aclose(self) -> None:
        await self._events.aclose()
        if not self._started:
            self._started = True  # ended once
            self._result.status = "aborted"
            await _relay_end(self._response, self._result, self._on_end)


async def _relay_end(response: StreamBody, result: UpstreamResult, on_end: Callable[[], None] | None) -> None:
    result.end()
    try:
        await response.aclose()
    finally:
        if on_end is not None:
            on_end()


async def relay_stream(response: StreamBody, *, result: UpstreamResult, rename: tuple[bytes, bytes],
                       client_wants_usage: bool, on_end: Callable[[], None] | None = None,
                       ) -> AsyncGenerator[bytes, None]:
    """The client's SSE events from the worker's, those of one upstream read together; closes the
    upstream however it ends, then calls `on_end` (the pipeline's settle). Sent as a `Relay`."""
    old, new = rename
    buffer = b""
    done = failed = False
    out: list[bytes] = []
    try:
        while chunk := await response.read():
            if result.first_byte_s is None:
                result.first_byte_s = time.perf_counter() - result.started
            if buffer:
                chunk = buffer + chunk
            cut = chunk.rfind(b"\n\n") + 2
            if cut == 1:  # no event complete yet
                buffer = chunk
                continue
            events, buffer = (chunk, b"") if cut == len(chunk) else (chunk[:cut], chunk[cut:])
            if _ROLE in events or _USAGE in events or DONE in events or _ERROR_EVENT in events:
                ended, error = _sort_events(events, out, result, client_wants_usage)
                done, failed = done or ended, failed or error
            else:
                # Content events only (each read but the first and the last): counted, not split.
                result.content_chunks += events.count(b"\n\n")
                out.append(events)
            if out and not done:  # once [DONE] came, the rest goes out with it
                # The worker's compact JSON has `"model":"<internal>"` once per event, and a JSON
                # string cannot hold it unescaped, so renaming every occurrence renames each event's.
                yield b"".join(out).replace(old, new)
                out = []
        if done:
            result.status = "upstream_error" if failed else "ok"
        else:
            result.status = "upstream_error"
            result.error = result.error or "the worker closed the stream before [DONE]"
            out.append(stream_error_event("The serving worker ended the stream early; the reply is incomplete."))
        yield b"".join(out).replace(old, new) + DONE
    except httpx.HTTPError as exc:
        result.status = "upstream_error"
        result.error = f"{type(exc).__name__}: {exc}"
        failure = stream_error_event("The connection to the serving worker failed mid-stream; the reply is incomplete.")
        yield b"".join(out).replace(old, new) + failure + DONE
    except BaseException:
        # The client left (the response task is cancelled) or the server is stopping.
        if result.status != "ok":
            result.status = "aborted"
        raise
    finally:
        await _relay_end(response, result, on_end)


def _sort_events(events: bytes, out: list[bytes], result: UpstreamResult, client_wants_usage: bool,
                 ) -> tuple[bool, bool]:
    """The complete `events` of a read that holds more than content, one by one: `[DONE]` (not
    passed on: it goes out last), the worker's error event (passed on, noted), the usage chunk
    (read; passed on if the client asked for it), the role's chunk and content. (done, failed)."""
    done = failed = False
    start = 0
    while (end := events.find(b"\n\n", start)) >= 0:
        event = events[start:end + 2]
        start = end + 2
        if event == DONE:
            done = True
        elif event.startswith(_ERROR_EVENT):
            failed = True
            result.error = event[6:506].decode(errors="replace")
            result.error_code = error_code(event[6:])
            out.append(event)
        elif _USAGE in event:
            try:
                result.take_usage(json.loads(event[6:]).get("usage"))
            except (ValueError, AttributeError):
                pass
            if client_wants_usage or _EMPTY_CHOICES not in event:
                out.append(event)
        else:
            if _ROLE not in event:
                result.content_chunks += 1
            out.append(event)
    return done, failed


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
