"""A templated stream chunk is byte for byte the chunk pydantic renders."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.contracts.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
)
from serving.engine.server.streaming import SseTemplate, sse

TRICKY = ["", "plain", ' "quoted" \\ back', "\n\r\t\b\f\x00\x1f\x7f", "\x85\u2028\u2029", "é中😀", "\ufffd", "@@text@@"]


def _response(model: str, text: str, token_ids: list[int] | None) -> CompletionResponse:
    choice = CompletionChoice(text=text, token_ids=token_ids)
    return CompletionResponse(id="cmpl-1", created=1700000000, model=model, choices=[choice])


@pytest.mark.parametrize("with_ids", [True, False])
@pytest.mark.parametrize("model", ["base", 'a"\u2028b:"text":"x"', "é"])
def test_template_renders_what_sse_renders(model: str, with_ids: bool) -> None:
    template = SseTemplate(
        _response(model, SseTemplate.TEXT_MARK, SseTemplate.IDS_MARK if with_ids else None),
        "text", "token_ids" if with_ids else None,
    )
    for text in TRICKY:
        for ids in ([], [5], [1, 22, 333]) if with_ids else (None,):
            assert template.render(text, ids) == sse(_response(model, text, ids))


@settings(max_examples=300, deadline=None)
@given(text=st.text(), ids=st.lists(st.integers(min_value=0, max_value=2**31)))
def test_any_text_and_ids_render_the_same(text: str, ids: list[int]) -> None:
    template = SseTemplate(_response("base", SseTemplate.TEXT_MARK, SseTemplate.IDS_MARK), "text", "token_ids")
    assert template.render(text, ids) == sse(_response("base", text, ids))


def test_a_payload_without_the_marker_is_refused() -> None:
    with pytest.raises(ValueError):
        SseTemplate(_response("base", "no marker", None), "text")


@settings(max_examples=200, deadline=None)
@given(text=st.text(), ids=st.lists(st.integers(min_value=0, max_value=2**31)), with_ids=st.booleans())
def test_chat_chunks_render_the_same(text: str, ids: list[int], with_ids: bool) -> None:
    def chunk(content: str, token_ids: list[int] | None) -> ChatCompletionChunk:
        choice = ChatChunkChoice(delta=ChatDelta(content=content), token_ids=token_ids)
        return ChatCompletionChunk(id="chatcmpl-1", created=1700000000, model="a0", choices=[choice])

    template = SseTemplate(chunk(SseTemplate.TEXT_MARK, SseTemplate.IDS_MARK if with_ids else None),
                           "content", "token_ids" if with_ids else None)
    assert template.render(text, ids if with_ids else None) == sse(chunk(text, ids if with_ids else None))
