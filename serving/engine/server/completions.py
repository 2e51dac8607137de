"""`POST /v1/completions`: prompts (text or token ids, one or a list) in, completions out, whole or
streamed.

Each prompt gets `n` choices (`best_of` generated), indexed prompt-major as OpenAI does
(`prompt_i * n + j`); usage sums the prompts' tokens and every returned choice's. A stream's chunks
each carry one choice, by its index, as OpenAI's SDK reads them. `echo` puts the prompt's text
(a prompt of token ids decoded) before its choices' text, in a stream with the choice's first chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from serving.engine import AsyncEngine
from serving.engine.server.generation import Delta, Generation, GenerationRequest
from serving.engine.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from serving.engine.server.streaming import GenerationStream, SseTemplate, sse
from serving.engine.server.worker import Worker


async def prompt_token_ids(engine: AsyncEngine, prompts: list[str | list[int]]) -> list[list[int]]:
    """Each prompt's token ids; text is encoded as the offline API encodes it (with BOS), on a
    thread: a long prompt takes seconds to tokenize, which the event loop must not wait for."""

    def encode() -> list[list[int]]:
        return [list(engine.tokenizer(p).input_ids) if isinstance(p, str) else list(p) for p in prompts]

    if all(isinstance(p, list) for p in prompts):
        return encode()
    return await asyncio.to_thread(encode)


def generation_request(body: CompletionRequest) -> GenerationRequest:
    return GenerationRequest(kind="cmpl", body=body, logprobs=body.logprobs, best_of=body.best_of,
                             prompt=lambda engine: prompt_token_ids(engine, body.prompts()))


async def create_completion(body: CompletionRequest, request: Request, worker: Worker) -> Response:
    generation, first = await Generation.start(worker, request, generation_request(body))
    if body.stream:
        return GenerationStream(_chunks(generation, first, body), generation)
    by_choice: dict[int, list[Delta]] = {}
    for delta in await generation.collect(first):
        by_choice.setdefault(delta.index, []).append(delta)
    choices = []
    for index, deltas in sorted(by_choice.items()):
        prompt = index // generation.n
        last = deltas[-1]
        choices.append(CompletionChoice(
            index=index,
            text=_echo(generation, body, prompt) + "".join(d.text for d in deltas),
            logprobs=_logprobs(generation, deltas, offset=0, top=body.logprobs or 0) if body.logprobs is not None else None,
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
            token_ids=[t for d in deltas for t in d.token_ids] if body.return_token_ids else None,
            prompt_token_ids=generation.prompts_token_ids[prompt] if body.return_token_ids else None,
        ))
    response = CompletionResponse(
        id=generation.request_id, created=generation.created, model=body.model, choices=choices,
        usage=generation.usage.info(),
    )
    return Response(response.model_dump_json(), media_type="application/json")


def _echo(generation: Generation, body: CompletionRequest, prompt: int) -> str:
    """What `echo` puts before prompt `prompt`'s choices: its text as sent, or its token ids decoded."""
    if not body.echo:
        return ""
    given = body.prompts()[prompt]
    return given if isinstance(given, str) else generation.decode(generation.prompts_token_ids[prompt])


async def _chunks(generation: Generation, first: Delta, body: CompletionRequest) -> AsyncIterator[bytes]:
    usage_each = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    offsets: dict[int, int] = {}
    # Choices whose first chunk went out (it alone carries the prompt's ids and echo).
    started: set[int] = set()
    # The chunk of a token mid-stream (no logprobs, no finish, no usage, nothing of the prompt's),
    # which is nearly every chunk, from a template per choice; the others are built whole.
    plain: dict[int, SseTemplate] | None = None if usage_each or body.logprobs is not None else {}
    delta: Delta | None = first
    while delta is not None:
        index = delta.index
        head = index not in started and bool(body.return_token_ids or body.echo)
        offset = offsets.get(index, 0)
        if (plain is not None and not head and delta.finish_reason is None and delta.stop_reason is None
                and (delta.text or body.return_token_ids and delta.token_ids)):
            if index not in plain:
                plain[index] = _plain_chunk(generation, body, index)
            yield plain[index].render(delta.text, delta.token_ids)
            offsets[index] = offset + len(delta.text)
        elif head or delta.text or delta.finish_reason or delta.token_ids and (body.return_token_ids or body.logprobs is not None):
            prompt = index // generation.n
            choice = CompletionChoice(
                index=index,
                text=(_echo(generation, body, prompt) if head else "") + delta.text,
                logprobs=_logprobs(generation, [delta], offset=offset, top=body.logprobs or 0) if body.logprobs is not None else None,
                finish_reason=delta.finish_reason,
                stop_reason=delta.stop_reason,
                token_ids=delta.token_ids if body.return_token_ids else None,
                prompt_token_ids=generation.prompts_token_ids[prompt] if body.return_token_ids and head else None,
            )
            started.add(index)
            yield sse(CompletionResponse(
                id=generation.request_id, created=generation.created, model=body.model, choices=[choice],
                usage=generation.usage.info() if usage_each else None,
            ))
            offsets[index] = offset + len(delta.text)
        delta = await generation.next()
    if body.stream_options and body.stream_options.include_usage:
        yield sse(CompletionResponse(
            id=generation.request_id, created=generation.created, model=body.model, choices=[],
            usage=generation.usage.info(),
        ))


def _plain_chunk(generation: Generation, body: CompletionRequest, index: int) -> SseTemplate:
    choice = CompletionChoice(index=index, text=SseTemplate.TEXT_MARK,
                              token_ids=SseTemplate.IDS_MARK if body.return_token_ids else None)
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
