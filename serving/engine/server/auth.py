"""The worker's one key: the operator's (`--api-key`, default `$SERVING_WORKER_API_KEY`).

With a key set, every `/v1/*` request must carry it (`Authorization: Bearer KEY`; the scheme in
any case, as HTTP says) or gets 401; `/health`, `/healthz` and `/readyz` stay open for probes.
`/metrics` is the operator's too (the key), or a scraper's on this machine (a loopback peer): its
adapter labels are `<tenant>/<adapter>@<version>`, every tenant's names, which no anonymous caller
on the network may list (issue 37, item 7; docs/operations.md, "Who may read the probes and metrics").
A request that carried it is the operator's: the gateway, or a person running the worker. Without
a key the worker is open and nobody is the operator, so what only the operator may do (see
docs/serving-worker.md: registry names on load/unload, storage paths in `/v1/models`) nobody can.
"""

from __future__ import annotations

import hmac
import ipaddress

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from serving.engine.server.errors import APIError, error_response

_OPERATOR = "loraplex.operator"


def bearer_token(authorization: str) -> str | None:
    """The credentials of an `Authorization: Bearer …` header (scheme case-insensitive), else None."""
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def is_operator(request: Request) -> bool:
    return bool(request.scope.get(_OPERATOR))


def is_local(scope: Scope) -> bool:
    """Whether the peer is on this machine: a loopback address, or no address (a Unix socket)."""
    client = scope.get("client")
    if not client:
        return True
    try:
        return ipaddress.ip_address(client[0]).is_loopback
    except ValueError:  # not an IP address: no peer we can place, so not local
        return False


class OperatorAuth:
    """ASGI middleware: 401 for a `/v1/*` request without the key; marks the operator's requests."""

    def __init__(self, app: ASGIApp, *, api_key: str | None) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._key is not None:
            token = bearer_token(Request(scope).headers.get("authorization", ""))
            presented = (token or "").encode()
            # compare_digest on every request, matching or not, so timing tells nothing of the key.
            scope[_OPERATOR] = hmac.compare_digest(presented, self._key) and token is not None
            keyed = scope["path"].startswith("/v1/") or scope["path"] == "/metrics" and not is_local(scope)
            if keyed and not scope[_OPERATOR]:
                response = error_response(APIError(
                    401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
