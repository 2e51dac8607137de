"""`POST /v1/completions`: a prompt (text or token ids) in, a completion out, whole or streamed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import cast

from starlette.requests import Request
from starlette.responses import Response

from serving.engine import AsyncEngine
from serving.engine.server.errors import bad_request
from serving.engine.server.generation import Delta, Generation, GenerationRequest
from serving.engine.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from serving.engine.server.streaming import GenerationStream, SseTemplate, sse
from serving.engine.server.worker import Worker


async def prompt_token_ids(engine: AsyncEngine, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
    """One prompt's token ids; text is encoded as the offline API encodes it (with BOS), on a
    thread: a long prompt takes seconds to tokenize, which the event loop must not wait for."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request(
                f"prompt holds {len(prompt)} prompts; this worker takes one prompt per request", param="prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        text = prompt
        return await asyncio.to_thread(lambda: list(engine.tokenizer(text).input_ids))
    # What is left of the union is one prompt of token ids.
    return list(cast(list[int], prompt))


def generation_request(body: CompletionRequest) -> GenerationRequest:
    return GenerationRequest(kind="cmpl", body=body, logprobs=body.logprobs,
                             prompt=lambda engine: prompt_token_ids(engine, body.prompt))


async def create_completion(body: CompletionRequest, request: Request, worker: Worker) -> Response:
    generation, first = await Generation.start(worker, request, generation_request(body))
    if body.stream:
        return GenerationStream(_chunks(generation, first, body), generation)
    deltas = await generation.collect(first)
    text = "".join(d.text for d in deltas)
    last = deltas[-1]
    choice = CompletionChoice(
        text=text,
        logprobs=_logprobs(generation, deltas, offset=0, top=body.logprobs or 0) if body.logprobs is not None else None,
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        token_ids=[t for d in deltas for t in d.token_ids] if body.return_token_ids else None,
        prompt_token_ids=generation.prompt_token_ids if body.return_token_ids else None,
    )
    response = CompletionResponse(
        id=generation.request_id, created=generation.created, model=body.model, choices=[choice],
        usage=generation.usage.info(),
    )
    return Response(response.model_dump_json(), media_type="application/json")


async def _chunks(generation: Generation, first: Delta, body: CompletionRequest) -> AsyncIterator[bytes]:
    usage_each = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    offset = 0
    delta: Delta | None = first
    sent_prompt_ids = False
    # The chunk of a token mid-stream (no logprobs, no finish, no usage, prompt ids sent), which
    # is nearly every chunk, from a template; the others are built whole.
    plain = None if usage_each or body.logprobs is not None else _plain_chunk(generation, body)
    while delta is not None:
        if (plain is not None and delta.finish_reason is None and delta.stop_reason is None
                and (sent_prompt_ids or not body.return_token_ids) and (delta.text or body.return_token_ids and delta.token_ids)):
            yield plain.render(delta.text, delta.token_ids)
            offset += len(delta.text)
        elif delta.text or delta.finish_reason or delta.token_ids and (body.return_token_ids or body.logprobs is not None):
            choice = CompletionChoice(
                text=delta.text,
                logprobs=_logprobs(generation, [delta], offset=offset, top=body.logprobs or 0) if body.logprobs is not None else None,
                finish_reason=delta.finish_reason,
                stop_reason=delta.stop_reason,
                token_ids=delta.token_ids if body.return_token_ids else None,
                prompt_token_ids=generation.prompt_token_ids if body.return_token_ids and not sent_prompt_ids else None,
            )
            sent_prompt_ids = sent_prompt_ids or body.return_token_ids
            yield sse(CompletionResponse(
                id=generation.request_id, created=generation.created, model=body.model, choices=[choice],
                usage=generation.usage.info() if usage_each else None,
            ))
            offset += len(delta.text)
        delta = await generation.next()
    if body.stream_options and body.stream_options.include_usage:
        yield sse(CompletionResponse(
            id=generation.request_id, created=generation.created, model=body.model, choices=[],
            usage=generation.usage.info(),
        ))


def _plain_chunk(generation: Generation, body: CompletionRequest) -> SseTemplate:
    choice = CompletionChoice(text=SseTemplate.TEXT_MARK, token_ids=SseTemplate.IDS_MARK if body.return_token_ids else None)
    payload = CompletionResponse(id=generation.request_id, created=generation.created, model=body.model, choices=[choice])
    return SseTemplate(payload, "text", "token_ids" if body.return_token_ids else None)


def _logprobs(generation: Generation, deltas: list[Delta], *, offset: int, top: int) -> CompletionLogprobs:
    """OpenAI's legacy logprobs: the chosen tokens, their logprobs, the `top` most likely tokens
    (and the chosen one) at each position, and each token's character offset in the completion."""
    decode = generation.decode
    result = CompletionLogprobs()
    for delta in deltas:
        for token_id, entry in zip(delta.token_ids, delta.logprobs or []):
            texts = {tid: lp.decoded_token if lp.decoded_token is not None else decode([tid]) for tid, lp in entry.items()}
            result.tokens.append(texts[token_id])
            result.token_logprobs.append(entry[token_id].logprob)
            result.text_offset.append(offset)
            offset += len(texts[token_id])
            result.top_logprobs.append({texts[tid]: lp.logprob for tid, lp in entry.items()} if top else None)
    return result
