"""The request id: one per HTTP request, in the `X-Request-ID` header between the processes it
crosses (client → web process → serving worker), on every log line written while the request is
served, and on its usage record.

The edge of each process (runtime.access_log) takes the id from the incoming header when it is
well-formed (a proxy in front, or the gateway calling a worker, minted it) and mints one otherwise;
`request_id_current()` is then that id for everything running in the request's context (tasks
started within it copy the context, so they see it too). A malformed header is replaced, never
repeated: the id goes into log lines and a database column, so it is a short token of safe
characters, never a caller's arbitrary text.
"""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar, Token

HEADER = "x-request-id"
# At most the usage record's column (serving.registry.models.UsageRecord.request_id); no spaces, quotes or
# control characters, so an id can neither break a log line nor forge one. UUIDs, nginx's
# $request_id (32 hex digits) and ids like "req-…", "Root=1-…" fit.
_WELL_FORMED = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+/=-]{0,63}")

_current: ContextVar[str | None] = ContextVar("loraplex_request_id", default=None)


def request_id_mint() -> str:
    return f"req-{uuid.uuid4().hex}"


def request_id_accepted(value: str | None) -> str | None:
    """`value` when it is a well-formed request id, else None."""
    if value is not None and _WELL_FORMED.fullmatch(value):
        return value
    return None


def request_id_for(header: str | None) -> str:
    """The id of a request whose `X-Request-ID` is `header` (None: it had none)."""
    return request_id_accepted(header) or request_id_mint()


def request_id_current() -> str | None:
    """The id of the request being served in this context; None outside one (startup, a Celery task)."""
    return _current.get()


def request_id_set(request_id: str | None) -> Token[str | None]:
    """Make `request_id` the current one; returns the token that `request_id_reset` takes."""
    return _current.set(request_id)


def request_id_reset(token: Token[str | None]) -> None:
    _current.reset(token)
