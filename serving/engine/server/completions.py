"""`POST /v1/completions`: prompts (text or token ids, one or a list) in, completions out, whole or
streamed.

Each prompt gets `n` choices (`best_of` generated), indexed prompt-major as OpenAI does
(`prompt_i * n + j`); usage sums the prompts' tokens and every generated one's, best_of's discarded
sequences included (as OpenAI bills them; issue 37). A stream's chunks
each carry one choice, by its index, as OpenAI's SDK reads them. `echo` puts the prompt's text
(a prompt of token ids decoded) before its choices' text, in a stream with the choice's first chunk;
with `logprobs`, the prompt's tokens come first in the logprobs too, the first with none (nothing
predicts it), as OpenAI returns them. A token's `text_offset` counts the texts of the tokens before
it in the choice (prompt's included), as vLLM does, whole and streamed alike. A constrained
(`guided_*`) choice cut by `max_tokens` carries `incomplete_details` (incomplete.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from serving.engine import EngineClient, Logprob
from serving.engine.server.generation import Delta, Generation, GenerationRequest
from serving.engine.server.incomplete import incomplete_details
from serving.contracts.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from serving.engine.server.streaming import GenerationStream, SseTemplate, sse
from serving.engine.server.worker import Worker


async def prompt_token_ids(engine: EngineClient, prompts: list[str | list[int]]) -> list[list[int]]:
    """Each prompt's token ids; text is encoded as the offline API encodes it (with BOS), on a
    thread: a long prompt takes seconds to tokenize, which the event loop must not wait for."""

    def encode() -> list[list[int]]:
        return [list(engine.tokenizer(p).input_ids) if isinstance(p, str) else list(p) for p in prompts]

    if all(isinstance(p, list) for p in prompts):
        return encode()
    return await asyncio.to_thread(encode)


def generation_request(body: CompletionRequest) -> GenerationRequest:
    return GenerationRequest(kind="cmpl", body=body, logprobs=body.logprobs, best_of=body.best_of,
                             prompt_logprobs=body.logprobs if body.echo else None,
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
            logprobs=_choice_logprobs(generation, body, prompt, deltas, offset=0, head=True)[0],
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
            token_ids=[t for d in deltas for t in d.token_ids] if body.return_token_ids else None,
            prompt_token_ids=generation.prompts_token_ids[prompt] if body.return_token_ids else None,
            incomplete_details=incomplete_details(body, last.finish_reason),
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
    offsets: dict[int, int] = {}  # per choice, the text offset of its next token (logprobs)
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
        elif head or delta.text or delta.finish_reason or delta.token_ids and (body.return_token_ids or body.logprobs is not None):
            prompt = index // generation.n
            logprobs, offsets[index] = _choice_logprobs(generation, body, prompt, [delta], offset=offset, head=head)
            choice = CompletionChoice(
                index=index,
                text=(_echo(generation, body, prompt) if head else "") + delta.text,
                logprobs=logprobs,
                finish_reason=delta.finish_reason,
                stop_reason=delta.stop_reason,
                token_ids=delta.token_ids if body.return_token_ids else None,
                prompt_token_ids=generation.prompts_token_ids[prompt] if body.return_token_ids and head else None,
                incomplete_details=incomplete_details(body, delta.finish_reason),
            )
            started.add(index)
            yield sse(CompletionResponse(
                id=generation.request_id, created=generation.created, model=body.model, choices=[choice],
                usage=generation.usage.info() if usage_each else None,
            ))
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


def _choice_logprobs(generation: Generation, body: CompletionRequest, prompt: int, deltas: list[Delta], *,
                     offset: int, head: bool) -> tuple[CompletionLogprobs | None, int]:
    """The logprobs of `deltas` (the first token at `offset`), after the prompt's when they open an
    echoed choice (None when not asked), and the offset after them."""
    if body.logprobs is None:
        return None, offset
    result = CompletionLogprobs()
    if head and body.echo:
        prompt_ids = generation.prompts_token_ids[prompt]
        offset = _add(result, generation, list(zip(prompt_ids, generation.prompt_logprobs[prompt])), offset=offset,
                      top=body.logprobs)
    offset = _add(result, generation, [pair for d in deltas for pair in zip(d.token_ids, d.logprobs or [])],
                  offset=offset, top=body.logprobs)
    return result, offset


def _add(result: CompletionLogprobs, generation: Generation, tokens: list[tuple[int, dict[int, Logprob] | None]], *,
         offset: int, top: int) -> int:
    """OpenAI's legacy logprobs of `tokens` (each with its logprobs entry, None for a prompt's
    first token) into `result`: the chosen tokens, their logprobs, the `top` most likely tokens (and
    the chosen one) at each position, and each token's character offset from `offset`; returns the
    offset after them."""
    decode = generation.decode
    for token_id, entry in tokens:
        texts = ({tid: lp.decoded_token if lp.decoded_token is not None else decode([tid]) for tid, lp in entry.items()}
                 if entry is not None else {token_id: decode([token_id])})
        result.tokens.append(texts[token_id])
        result.token_logprobs.append(entry[token_id].logprob if entry is not None else None)
        result.text_offset.append(offset)
        offset += len(texts[token_id])
        result.top_logprobs.append({texts[tid]: lp.logprob for tid, lp in entry.items()}
                                   if top and entry is not None else None)
    return offset
