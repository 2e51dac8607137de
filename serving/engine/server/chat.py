"""`POST /v1/chat/completions`: messages through the tokenizer's chat template, a reply out, whole
or streamed. The prompt is built exactly as the offline `LLM.chat` builds it, so the same
conversation gives the same tokens through either; the one exception is tools on a template that
does not render them (tool_prompt.py), where the worker writes its own tool prompt and the offline
API, which reads no replies for calls, passes the tools to the template as they are.

The template and the tokenizer run on threads, never on the event loop, so a long conversation
does not hold up other requests or `/health`. A caller's own template (`chat_template`, or
`chat_template_kwargs.chat_template`) is code from the caller: refused with 400 unless the
operator passed `--trust-request-chat-template`, and then rendered in a sandboxed child process
with limits (chat_template_sandbox.py). `chat_template_kwargs` are template variables only: the
names of `apply_chat_template`'s own parameters are refused there.

Tools (`tools=` to the template, or the worker's own tool prompt for a template without a tool
format this worker reads; the reply read for calls, the grammar of `required` or a named function)
are the tool_* modules'; here they are resolved once the prompt is built and applied to the reply.
A structured reply (a constraint: `response_format`, a `guided_*` field, forced tool calls) that
`max_tokens` cuts carries `incomplete_details` (incomplete.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from serving.engine import EngineClient
from serving.engine.guided import GrammarError
from serving.engine.server.chat_template_sandbox import TemplateRefused
from serving.engine.server.errors import bad_request
from serving.engine.server.generation import Delta, Generation, GenerationRequest
from serving.contracts.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
)
from serving.engine.server.streaming import GenerationStream, SseTemplate, sse
from serving.engine.server.tool_grammar import tool_call_grammar
from serving.engine.server.incomplete import incomplete_details
from serving.engine.server.tool_parsers import Family, family_for
from serving.engine.server.tool_prompt import is_prompted, prompted_messages
from serving.engine.server.tool_replies import ToolReplies
from serving.engine.server.tool_requests import ToolPlan, template_messages, tool_plan
from serving.engine.server.worker import Worker


# apply_chat_template's own parameters: through chat_template_kwargs they would change how the
# prompt is built (tokenize, truncation, …) rather than fill the template.
_RESERVED_KWARGS = frozenset({
    "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize",
    "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def _caller_template(worker: Worker, body: ChatCompletionRequest, variables: dict[str, Any]) -> str | None:
    """The caller's own template, taken out of `variables`; 400 unless the operator trusts them."""
    from_kwargs = variables.pop("chat_template", None)
    template = body.chat_template if body.chat_template is not None else from_kwargs
    if template is None:
        return None
    param = "chat_template" if body.chat_template is not None else "chat_template_kwargs.chat_template"
    if not worker.args.trust_request_chat_template:
        raise bad_request(
            "This worker renders its model's own chat template only; a request's chat template is refused "
            "(an operator can allow them with --trust-request-chat-template).", param=param)
    if not isinstance(template, str):
        raise bad_request("chat_template must be a string holding a Jinja template", param=param)
    return template


@dataclass
class ChatTools:
    """The request's tools as resolved for the model when its prompt is built."""

    plan: ToolPlan | None = None
    family: Family | None = None
    # The worker writes the tools and their calls into the prompt (tool_prompt.py), not the template.
    prompted: bool = False

    def replies(self) -> ToolReplies | None:
        """The reader of this reply's calls; None when the reply is not read for them."""
        if self.plan is None or not self.plan.parses or self.family is None:
            return None
        return ToolReplies(self.plan, self.family)


async def _resolve_tools(worker: Worker, engine: EngineClient, body: ChatCompletionRequest,
                         template_text: str | None, tools: ChatTools) -> None:
    """`tools` for this request; a reply that must be calls is held to their grammar."""
    tools.family = family_for(worker.args.tool_call_parser, template_text)
    tools.prompted = is_prompted(tools.family, template_text)
    tools.plan = plan = tool_plan(body, tools.family)
    if plan is None or not plan.forced:
        return
    assert tools.family is not None  # a plan that parses has a family (tool_plan)
    try:
        grammar = await asyncio.to_thread(tool_call_grammar, tools.family, plan.callable_functions(),
                                          parallel=plan.parallel, budget=engine.config.grammar)
    except GrammarError as exc:
        raise bad_request(str(exc), param="functions" if plan.legacy else "tools", code=exc.code) from exc
    body.hold_to_tool_calls(plan.field, grammar)


def _template_text(tokenizer: Any) -> str | None:
    template = tokenizer.chat_template
    # A tokenizer may keep several named templates.
    return "\n".join(template.values()) if isinstance(template, dict) else template


async def chat_prompt_token_ids(worker: Worker, engine: EngineClient, body: ChatCompletionRequest,
                                tools: ChatTools) -> list[int]:
    tokenizer = engine.tokenizer
    variables = dict(body.chat_template_kwargs or {})
    template = _caller_template(worker, body, variables)
    reserved = sorted(_RESERVED_KWARGS & set(variables))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}: they are not template "
                          "variables but parameters of how the prompt is built", param="chat_template_kwargs")
    await _resolve_tools(worker, engine, body, template if template is not None else _template_text(tokenizer), tools)
    try:
        messages = template_messages(body.messages)
    except ValueError as exc:  # a content part that is not text
        raise bad_request(f"The chat template could not render these messages: {exc}", param="messages") from exc
    offered = tools.plan.template_tools() if tools.plan is not None and not tools.prompted else None

    async def render(messages: list[dict[str, Any]]) -> str:
        if template is None:
            rendered = await asyncio.to_thread(
                tokenizer.apply_chat_template, messages, tokenize=False,
                # (a list of apply_chat_template's own element type: list is invariant)
                tools=None if offered is None else list[dict[Any, Any] | Callable[..., Any]](offered),
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message, **variables,
            )
            assert isinstance(rendered, str)  # tokenize=False
            return rendered
        return await worker.chat_template_sandbox.render(  # type: ignore[union-attr]
            template, messages, tools=offered, add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            # As apply_chat_template: the special tokens are variables, the caller's win.
            variables={**tokenizer.special_tokens_map, **variables},
        )

    try:
        if not tools.prompted:
            text = await render(messages)
        else:
            assert tools.family is not None  # prompted only with a family (is_prompted)
            try:
                text = await render(prompted_messages(messages, tools.family, tools.plan))
            except Exception:
                if any(message["role"] == "system" for message in messages):
                    raise
                # A template that refuses a system message (Gemma's) gets the tool prompt in the first user
                # turn: tried once more (a caller's template in the sandbox too, so at most twice its limits).
                text = await render(prompted_messages(messages, tools.family, tools.plan, system=False))
    except TemplateRefused as exc:
        raise bad_request(f"The request's chat template was refused: {exc}", param="chat_template") from exc
    except Exception as exc:  # a template raises whatever its Jinja code raises
        raise bad_request(f"The chat template could not render these messages: {exc}", param="messages") from exc
    return await asyncio.to_thread(lambda: list(tokenizer(text, add_special_tokens=False).input_ids))


def generation_request(worker: Worker, body: ChatCompletionRequest, tools: ChatTools) -> GenerationRequest:
    return GenerationRequest(kind="chatcmpl", body=body, logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                             prompt=lambda engine: chat_prompt_token_ids(worker, engine, body, tools))


async def create_chat_completion(body: ChatCompletionRequest, request: Request, worker: Worker) -> Response:
    tools = ChatTools()
    generation, first = await Generation.start(worker, request, generation_request(worker, body, tools))
    if body.stream:
        return GenerationStream(_chunks(generation, first, body, tools), generation)
    by_choice: dict[int, list[Delta]] = {}
    for delta in await generation.collect(first):
        by_choice.setdefault(delta.index, []).append(delta)
    response = ChatCompletionResponse(
        id=generation.request_id, created=generation.created, model=body.model,
        choices=[_choice(generation, body, index, deltas, tools.replies()) for index, deltas in sorted(by_choice.items())],
        usage=generation.usage.info(), prompt_token_ids=generation.prompt_token_ids if body.return_token_ids else None,
    )
    return Response(response.model_dump_json(), media_type="application/json")


def _choice(generation: Generation, body: ChatCompletionRequest, index: int, deltas: list[Delta],
            replies: ToolReplies | None) -> ChatChoice:
    """Choice `index` of a whole reply (`n` > 1: each read for tool calls on its own)."""
    last = deltas[-1]
    text = "".join(d.text for d in deltas)
    message, finish_reason = (replies.message(text, last.finish_reason) if replies is not None
                              else (ChatResponseMessage(content=text), last.finish_reason))
    return ChatChoice(
        index=index,
        message=message,
        logprobs=_logprobs(generation, deltas, body.top_logprobs or 0) if body.logprobs else None,
        finish_reason=finish_reason,
        stop_reason=last.stop_reason,
        token_ids=[t for d in deltas for t in d.token_ids] if body.return_token_ids else None,
        incomplete_details=incomplete_details(body, finish_reason),
    )


async def _chunks(generation: Generation, first: Delta, body: ChatCompletionRequest,
                  tools: ChatTools) -> AsyncIterator[bytes]:
    usage_each = bool(body.stream_options and body.stream_options.continuous_usage_stats)

    def chunk(choice: ChatChunkChoice | None, *, usage: bool, prompt_ids: bool = False) -> bytes:
        return sse(ChatCompletionChunk(
            id=generation.request_id, created=generation.created, model=body.model,
            choices=[choice] if choice is not None else [],
            usage=generation.usage.info() if usage else None,
            prompt_token_ids=generation.prompt_token_ids if prompt_ids and body.return_token_ids else None,
        ))

    # Each choice's reader of tool calls (`n` > 1: one per choice), from its first delta on.
    readers: dict[int, ToolReplies | None] = {}
    delta: Delta | None = first
    # A token's chunk mid-stream (no logprobs, no finish, no usage) from a template per choice, as
    # completions do. (A reply read for tool calls holds text back while a call may be starting: no
    # template then.)
    plain: dict[int, SseTemplate] | None = None if usage_each or body.logprobs or tools.replies() is not None else {}
    while delta is not None:
        index = delta.index
        if index not in readers:
            # OpenAI's first chunk of a choice carries the role and no content.
            readers[index] = tools.replies()
            yield chunk(ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content="")), usage=usage_each,
                        prompt_ids=not index)
        replies = readers[index]
        if plain is not None and delta.finish_reason is None and (delta.text or body.return_token_ids and delta.token_ids):
            if index not in plain:
                plain[index] = _plain_chunk(generation, body, index)
            yield plain[index].render(delta.text, delta.token_ids)
            delta = await generation.next()
            continue
        chat_delta, finish_reason = (replies.delta(delta.text, delta.finish_reason) if replies is not None
                                     else (ChatDelta(content=delta.text), delta.finish_reason))
        said = chat_delta.content or chat_delta.tool_calls or chat_delta.function_call
        if said or finish_reason or delta.token_ids and (body.return_token_ids or body.logprobs):
            yield chunk(ChatChunkChoice(
                index=index,
                delta=chat_delta,
                logprobs=_logprobs(generation, [delta], body.top_logprobs or 0) if body.logprobs else None,
                finish_reason=finish_reason,
                stop_reason=delta.stop_reason,
                token_ids=delta.token_ids if body.return_token_ids else None,
                incomplete_details=incomplete_details(body, finish_reason),
            ), usage=usage_each)
        delta = await generation.next()
    if body.stream_options and body.stream_options.include_usage:
        yield chunk(None, usage=True)


def _plain_chunk(generation: Generation, body: ChatCompletionRequest, index: int) -> SseTemplate:
    choice = ChatChunkChoice(index=index, delta=ChatDelta(content=SseTemplate.TEXT_MARK),
                             token_ids=SseTemplate.IDS_MARK if body.return_token_ids else None)
    payload = ChatCompletionChunk(id=generation.request_id, created=generation.created, model=body.model, choices=[choice])
    return SseTemplate(payload, "content", "token_ids" if body.return_token_ids else None)


def _logprobs(generation: Generation, deltas: list[Delta], top: int) -> ChatLogprobs:
    """OpenAI's chat logprobs: per token, its logprob, its bytes and the `top` most likely tokens."""
    decode = generation.decode
    content = []
    for delta in deltas:
        for token_id, entry in zip(delta.token_ids, delta.logprobs or []):

            def item(tid: int) -> ChatTopLogprob:
                lp = entry[tid]
                text = lp.decoded_token if lp.decoded_token is not None else decode([tid])
                return ChatTopLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()))

            chosen = item(token_id)
            ranked = sorted(entry.items(), key=lambda pair: pair[1].rank)
            top_k = [item(tid) for tid, lp in ranked if lp.rank <= top]
            content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=top_k))
    return ChatLogprobs(content=content)
