"""The access log at a server's edge (runtime.access_log) and the request-id rule
(serving.contracts.request_ids): an incoming well-formed X-Request-ID is kept, anything else replaced by
a minted one, the id goes back in the response and is current while the application runs, and each
request is one line with what the application noted."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from runtime.access_log import CLIENT_CLOSED, AccessLog, access_note
from serving.contracts.request_ids import request_id_accepted, request_id_current, request_id_for

LOGGER = "loraplex.test.access"


class App:
    """A downstream ASGI application: answers `status`, notes fields, remembers the current id."""

    def __init__(self, status: int = 200, headers: list[tuple[bytes, bytes]] | None = None,
                 respond: bool = True) -> None:
        self.status, self.headers, self.respond = status, headers or [], respond
        self.seen_id: str | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.seen_id = request_id_current()
        access_note(tenant="acme", model="bot")
        if not self.respond:
            return
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": b"{}"})


def call(app: App, *, path: str = "/v1/completions", request_id: bytes | None = None,
         quiet: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    headers = [(b"host", b"testserver")] + ([(b"x-request-id", request_id)] if request_id is not None else [])
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(AccessLog(app, logger=LOGGER, quiet=quiet)(scope, receive, send))
    return sent


def response_ids(sent: list[dict[str, Any]]) -> list[bytes]:
    return [value for name, value in sent[0]["headers"] if name == b"x-request-id"]


def test_a_well_formed_incoming_id_is_kept_returned_and_current(caplog: pytest.LogCaptureFixture) -> None:
    app = App()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        sent = call(app, request_id=b"client-7f3a.1")
    assert response_ids(sent) == [b"client-7f3a.1"] and app.seen_id == "client-7f3a.1"
    (record,) = caplog.records
    assert record.getMessage().startswith("POST /v1/completions 200 ")
    assert record.getMessage().endswith(" ms tenant=acme model=bot")
    assert (record.method, record.path, record.status, record.tenant, record.model) == (
        "POST", "/v1/completions", 200, "acme", "bot")
    assert record.duration_ms >= 0 and record.request_id == "client-7f3a.1"
    assert request_id_current() is None, "the id is the request's only"


@pytest.mark.parametrize("header", [None, b"", b"has spaces", b"quote\"d", b"x" * 65, b"-leading-dash", b"\xff\xfe"])
def test_a_missing_or_malformed_id_is_replaced_by_a_minted_one(header: bytes | None) -> None:
    app = App()
    (minted,) = response_ids(call(app, request_id=header))
    assert minted.startswith(b"req-") and len(minted) == 36 and app.seen_id == minted.decode()


def test_an_id_the_application_set_is_not_repeated() -> None:
    sent = call(App(headers=[(b"x-request-id", b"req-own")]), request_id=b"req-own")
    assert response_ids(sent) == [b"req-own"]


def test_probes_are_debug_and_a_response_never_started_is_499(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        call(App(), path="/health", quiet=("/health",))
        call(App(respond=False))
    probe, gone = caplog.records
    assert probe.levelno == logging.DEBUG and probe.path == "/health"
    assert gone.levelno == logging.INFO and gone.status == CLIENT_CLOSED


def test_an_application_that_raises_is_logged_as_500(caplog: pytest.LogCaptureFixture) -> None:
    class Failing(App):
        async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
            raise RuntimeError("boom")

    with caplog.at_level(logging.INFO, logger=LOGGER), pytest.raises(RuntimeError):
        call(Failing())
    assert caplog.records[0].status == 500


def test_the_request_id_rule() -> None:
    for good in ("req-0123456789abcdef0123456789abcdef", "3fa85f64-5717-4562-b3fc-2c963f66afa6",
                 "Root=1-5759e988-bd862e3fe1be46a994272793", "a" * 64):
        assert request_id_accepted(good) == good and request_id_for(good) == good
    for bad in ("", " x", "a b", "a\nb", "a" * 65, "_x", "x;y"):
        assert request_id_accepted(bad) is None and request_id_for(bad).startswith("req-")
