"""SSE relay alone: events pass through one by one with `model` renamed, the usage chunk is read
and dropped unless asked for, a failing upstream ends the stream with an error event, and a
worker's error event is passed on with its code read for the breaker."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from runtime.breakers import Outcome
from serving.gateway.proxy import DONE, Relay, UpstreamResult, rename_model
from serving.gateway.resilience import breaker_outcome

INTERNAL = "alice-co/support-bot@1.0.0"


def event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def chunk(text: str, finish: str | None = None) -> bytes:
    return event({"id": "c", "object": "text_completion", "created": 1, "model": INTERNAL,
                  "choices": [{"index": 0, "text": text, "finish_reason": finish}], "usage": None})


USAGE = event({"id": "c", "object": "text_completion", "created": 1, "model": INTERNAL, "choices": [],
               "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})


class Parts:
    """A reply's body as the network may cut it (events split across reads), then optionally a failure."""

    def __init__(self, parts: list[bytes], fail: bool = False) -> None:
        self.parts = list(parts)
        self.fail = fail
        self.closed = False

    async def read(self) -> bytes:
        if self.parts:
            return self.parts.pop(0)
        if self.fail:
            raise httpx.ReadError("connection reset")
        return b""

    async def aclose(self) -> None:
        self.closed = True


def relay(parts: list[bytes], *, wants_usage: bool, fail: bool = False) -> tuple[list[bytes], UpstreamResult]:
    """The events the client gets (split out of what the relay sends)."""
    sent, result = relay_sends(parts, wants_usage=wants_usage, fail=fail)
    return [piece + b"\n\n" for piece in b"".join(sent).split(b"\n\n")[:-1]], result


def renamed(data: bytes) -> bytes:
    return data.replace(INTERNAL.encode(), b"support-bot")


def relay_sends(parts: list[bytes], *, wants_usage: bool, fail: bool = False) -> tuple[list[bytes], UpstreamResult]:
    """What the relay sends, piece by piece."""
    async def scenario() -> tuple[list[bytes], UpstreamResult]:
        body, ended = Parts(parts, fail), []
        result = UpstreamResult(worker_id="w")
        out = [item async for item in Relay(body, result=result, rename=rename_model(INTERNAL, "support-bot"),
                                            client_wants_usage=wants_usage, on_end=lambda: ended.append(body.closed))]
        assert ended == [True], "the upstream is closed, then on_end called, once"
        return out, result

    return asyncio.run(scenario())


def test_a_client_gone_before_the_first_event_still_closes_the_upstream_and_settles_once():
    """The edge sends the head, then reads the relay: a client gone at the head (its send raises, or
    the response task is cancelled there) never reads an event, and the reply is settled all the same."""
    from serving.gateway.asgi import _send_reply
    from serving.gateway.records import Reply

    async def scenario() -> tuple[list[bool], UpstreamResult, Parts]:
        body, ended = Parts([chunk("never read") + DONE], False), []
        result = UpstreamResult(worker_id="w")
        relay = Relay(body, result=result, rename=rename_model(INTERNAL, "support-bot"), client_wants_usage=False,
                      on_end=lambda: ended.append(body.closed))

        async def send(message: dict) -> None:
            raise OSError("the client is gone")

        with pytest.raises(OSError):
            await _send_reply(Reply(status=200, headers={}, stream=relay), send)
        await relay.aclose()  # a second close ends nothing twice
        return ended, result, body

    ended, result, body = asyncio.run(scenario())
    assert ended == [True] and body.parts, "the upstream closed unread, then settled once"
    assert result.status == "aborted" and result.ended_s is not None


def test_events_pass_through_renamed_and_usage_is_read_but_not_shown_unless_asked():
    stream = chunk("Hel") + chunk("lo", "stop") + USAGE + DONE
    parts = [stream[:10], stream[10:57], stream[57:]]  # cut anywhere
    out, result = relay(parts, wants_usage=False)
    assert out == [chunk("Hel").replace(INTERNAL.encode(), b"support-bot"),
                   chunk("lo", "stop").replace(INTERNAL.encode(), b"support-bot"), DONE]
    assert result.status == "ok" and result.usage_known
    assert (result.prompt_tokens, result.completion_tokens, result.content_chunks) == (5, 2, 2)

    shown, _ = relay([stream], wants_usage=True)
    assert json.loads(shown[2][6:])["usage"]["total_tokens"] == 7 and json.loads(shown[2][6:])["model"] == "support-bot"


def test_the_events_of_one_upstream_read_go_out_in_one_piece_and_done_with_the_last():
    sent, result = relay_sends([chunk("a") + chunk("b"), chunk("c")[:20], chunk("c")[20:] + chunk("d", "stop"),
                                USAGE + DONE], wants_usage=False)
    assert sent == [renamed(chunk("a") + chunk("b")), renamed(chunk("c") + chunk("d", "stop")), DONE]
    sent, _ = relay_sends([chunk("a"), chunk("b", "stop") + USAGE + DONE], wants_usage=True)
    assert sent == [renamed(chunk("a")), renamed(chunk("b", "stop") + USAGE) + DONE]
    assert result.status == "ok" and result.content_chunks == 4


def test_an_upstream_failure_mid_stream_ends_with_an_error_event_and_done():
    out, result = relay([chunk("Hel")], wants_usage=False, fail=True)
    assert out[-1] == DONE
    error = json.loads(out[-2][6:])["error"]
    assert error["code"] == "upstream_error" and "mid-stream" in error["message"]
    assert result.status == "upstream_error" and result.content_chunks == 1


def test_a_stream_cut_before_done_is_an_error_and_a_worker_error_event_is_passed_on():
    out, result = relay([chunk("Hel")], wants_usage=False)
    assert json.loads(out[-2][6:])["error"]["code"] == "upstream_error" and result.status == "upstream_error"

    worker_error = event({"error": {"message": "engine died", "type": "api_error", "param": None, "code": None}})
    out, result = relay([chunk("a"), worker_error, DONE], wants_usage=False)
    assert out[1] == worker_error and out[-1] == DONE and result.status == "upstream_error"


def test_a_stream_stopped_by_a_corrupted_slot_is_relayed_and_is_the_workers_state_for_the_breaker():
    stopped = event({"error": {"message": "GPU slot 0 of 'support-bot' failed its checksum", "type": "service_unavailable",
                               "param": None, "code": "adapter_slot_corrupted"}})
    out, result = relay([chunk("a"), stopped, DONE], wants_usage=False)
    assert out[1:] == [stopped, DONE]
    assert (result.status, result.error_code) == ("upstream_error", "adapter_slot_corrupted")
    assert breaker_outcome(result) is Outcome.IGNORED

    other = event({"error": {"message": "The stream failed", "type": "api_error", "param": None, "code": "boom"}})
    _, result = relay([chunk("a"), other, DONE], wants_usage=False)
    assert result.error_code == "boom" and breaker_outcome(result) is Outcome.FAILURE


def test_a_chat_stream_cut_at_any_place_relays_the_same_events_and_counts_its_content_chunks():
    role = event({"id": "c", "object": "chat.completion.chunk", "model": INTERNAL,
                  "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    content = [event({"id": "c", "object": "chat.completion.chunk", "model": INTERNAL,
                      "choices": [{"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}]})
               for i in range(6)]
    stream = role + b"".join(content) + USAGE + DONE
    for step in (1, 5, 40, len(content[0]), len(stream)):
        parts = [stream[at:at + step] for at in range(0, len(stream), step)]
        out, result = relay(parts, wants_usage=False)
        assert out == [renamed(role), *map(renamed, content), DONE]
        assert result.content_chunks == 6 and result.status == "ok" and result.completion_tokens == 2
        # Cut before its usage: what was relayed is what is counted.
        out, result = relay(parts[:len(stream[:-len(USAGE + DONE)]) // step], wants_usage=False)
        shown = [e for e in out[:-2] if b'"content":"t' in e]
        assert result.content_chunks == len(shown) and not result.usage_known
