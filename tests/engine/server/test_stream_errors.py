"""A stream that fails after its headers says why in the stream and in the worker's log, by request id."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import pytest

from serving.engine.server.errors import APIError
from serving.engine.server.streaming import DONE, guarded


async def _failing(exc: Exception) -> AsyncIterator[bytes]:
    yield b"data: {}\n\n"
    raise exc


async def _drain(chunks: AsyncIterator[bytes]) -> list[bytes]:
    return [chunk async for chunk in chunks]


@pytest.mark.parametrize("exc", [RuntimeError("boom"), APIError(409, "stopped", code="adapter_slot_corrupted")])
def test_an_exception_mid_stream_is_logged_with_the_request_id(exc: Exception, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="serving.engine.server.streaming"):
        chunks = asyncio.run(_drain(guarded(_failing(exc), "cmpl-abc123")))
    assert chunks[0] == b"data: {}\n\n" and chunks[-1] == DONE
    assert "error" in json.loads(chunks[1][len(b"data: "):])
    # A stop the worker names is a warning; anything else is a defect, logged as an error.
    expected = logging.WARNING if isinstance(exc, APIError) else logging.ERROR
    assert [r.levelno for r in caplog.records] == [expected]
    assert "cmpl-abc123" in caplog.records[0].getMessage()
