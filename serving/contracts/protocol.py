"""Request and response bodies of the HTTP API, in OpenAI's shape with vLLM's extra fields.

Requests accept unknown fields silently (clients send `user`, `metadata`, `store`, …), as OpenAI
and vLLM do. A field this worker knows but cannot honour in a request is refused with a 400 that
names it (`refused_fields`), instead of being ignored and giving the caller something other than
what was asked: `suffix` (no served model has a fill-in-the-middle template), and on completions
`best_of` > `n` streamed (the `n` returned are known only at the end).

vLLM extensions kept with vLLM's names: `top_k`, `ignore_eos`, `stop_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`, `repetition_penalty`, `min_tokens`, `priority`
(lower is served first), `cache_salt` (only requests of the same salt share cached prompt blocks),
`return_token_ids` (the prompt's and the completion's token ids in the response),
`add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`, and structured output's
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (on both endpoints; chat also takes
OpenAI's `response_format`). `constraints()` lists those set, as the engine's GuidedDecodingParams
fields; generation.py refuses more than one. A choice held to one of them that `max_tokens` cut
says so in `incomplete_details` (Loraplex's extension, named after the Responses API's field).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from serving.contracts import request_caps


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _extension() -> Any:
    """A vLLM extension field: left out of the JSON unless set."""
    return Field(default=None, exclude_if=lambda value: value is None)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class RegistryAdapterRef(_Request):
    """Where the registry keeps the version `model` names (see server.on_demand)."""

    artifact_uri: str = Field(min_length=1)
    manifest_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    stop: str | list[str] | None = None
    # What the engine's torch.Generator takes (a larger one failed there with "Overflow when unpacking long long").
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    # vLLM's: mixed into the prefix cache's keys, so only requests of the same salt share a prefix.
    cache_salt: str | None = Field(default=None, min_length=1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    # Loraplex's gateway only (server.on_demand): load `model` from the registry on first use.
    loraplex_adapter: RegistryAdapterRef | None = None
    # `n` completions of each prompt; OpenAI's penalties and logit_bias (token id -> bias), vLLM's
    # repetition_penalty and min_tokens (serving.engine.penalties).
    n: int | None = Field(default=1, ge=1)
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(default=0, ge=0)
    # vLLM's structured output (serving.engine.guided): the output matches a JSON schema (an object
    # or its JSON text), a regex, one of the strings, or an EBNF grammar.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def constraints(self) -> list[tuple[str, dict[str, Any]]]:
        """(field, GuidedDecodingParams keyword arguments) for each structured-output field set."""
        found: list[tuple[str, dict[str, Any]]] = []
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append((name, {key: value}))
        return found

    def refused_fields(self) -> list[tuple[str, str]]:
        """`(field, why)` for each field set to something this worker cannot do."""
        return []


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`. `prompt` is one prompt (a string, or token ids) or a list of them;
    choices are indexed prompt-major (`prompt_i * n + j`), as OpenAI. `echo` puts each prompt's
    text before its completions (with `logprobs`, the prompt's tokens and logprobs before theirs);
    `best_of` generates that many and returns the `n` most likely."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=request_caps.MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, (str, list)) for p in prompt):
            return list(prompt)  # type: ignore[arg-type]  # a list of strings or of token-id lists
        return [prompt]  # type: ignore[list-item]  # one prompt of token ids

    def refused_fields(self) -> list[tuple[str, str]]:
        refused = super().refused_fields()
        n = self.n or 1
        if self.suffix:
            refused.append(("suffix", "suffix (fill-in-the-middle) needs a model with an infilling template, and the "
                                      "models this worker serves have none; send the prompt without a suffix"))
        if self.best_of is not None and self.best_of < n:
            refused.append(("best_of", f"best_of ({self.best_of}) must be at least n ({n})"))
        if self.stream and self.best_of is not None and self.best_of > n:
            refused.append(("best_of", "best_of greater than n cannot be streamed: the n returned are known only "
                                       "once all best_of have ended; send stream=false or best_of equal to n"))
        if isinstance(self.prompt, list) and not self.prompt:
            refused.append(("prompt", "prompt is an empty list; send a prompt, or a list of them"))
        return refused


class FunctionDefinition(_Request):
    """A function the model may call (OpenAI's `tools[].function`, or a legacy `functions` item)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: the function takes no arguments
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    """`tool_choice` naming the function the reply must call."""

    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Request):
    """A call the assistant made, in the history: `arguments` is the JSON text of an object."""

    name: str
    arguments: str


class MessageToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Request):
    # `function` is the legacy role of a function's result (with `name`), as `tool` with `tool_call_id`.
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    function_call: CalledFunction | None = None  # legacy: an assistant's one call

    def text(self) -> str:
        """The message's text; a list of parts must hold text parts only."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"only text content parts are supported, got a part of type {part.get('type')!r}"
                )
            texts.append(part["text"])
        return "".join(texts)


class JsonSchemaFormat(_Request):
    """OpenAI's `response_format.json_schema`. The output is held to `schema` whether or not
    `strict` is set (a grammar either constrains or does not): strict's promise is kept either way."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    # `schema` is a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's `response_format`: free text, any JSON object, or JSON that validates against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs its json_schema: {name, schema, strict}")
        return self


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`. `max_completion_tokens` is OpenAI's newer name for `max_tokens`.
    Tools (`tools`, `tool_choice`, `parallel_tool_calls`, the legacy `functions` and `function_call`)
    are resolved against the model by server.tool_requests."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=request_caps.MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the caller's own Jinja template; refused unless --trust-request-chat-template.
    chat_template: str | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | FunctionName | None = None
    response_format: ResponseFormat | None = None
    # (field, EBNF) holding the reply to tool calls (tool_choice required or named), set by the
    # chat handler once it knows the model's tool-call format.
    _tool_grammar: tuple[str, str] | None = PrivateAttr(default=None)

    def hold_to_tool_calls(self, field: str, grammar: str) -> None:
        """Constrain the reply to `grammar` (tool_grammar.py), reported as `field` in errors."""
        self._tool_grammar = (field, grammar)

    @model_validator(mode="after")
    def _one_max_tokens(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens disagree; send one of them")
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self

    def constraints(self) -> list[tuple[str, dict[str, Any]]]:
        found = super().constraints()
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.json_schema is not None:
            found.append(("response_format", {"json": fmt.json_schema.json_schema}))
        if self._tool_grammar is not None:
            name, grammar = self._tool_grammar
            found.append((name, {"grammar": grammar}))
        return found


class LoadLoRAAdapterRequest(_Request):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class PrefetchAdapter(RegistryAdapterRef):
    lora_name: str = Field(min_length=1)
    # Also into a GPU slot (one that is free or idle: never a pinned or busy one).
    to_gpu: bool = False


class PrefetchLoRAAdaptersRequest(_Request):
    """Registry versions to load ahead of their traffic, most wanted first (server.prefetch)."""

    adapters: list[PrefetchAdapter] = Field(max_length=4096)


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


# Responses -----------------------------------------------------------------------------------


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(_Response):
    cached_tokens: int


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # OpenAI's field: prompt tokens the prefix cache held; left out when the worker's caching is off.
    prompt_tokens_details: PromptTokensDetails | None = _extension()


class CompletionLogprobs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class IncompleteDetails(_Response):
    """Why a structured reply (one held to a constraint) is not a complete match: `max_tokens`
    ended it before the model did (finish_reason "length"). `param`: the constraint's field."""

    reason: Literal["max_tokens"] = "max_tokens"
    param: str
    message: str


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _extension()
    prompt_token_ids: list[int] | None = _extension()
    incomplete_details: IncompleteDetails | None = _extension()


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # the JSON text of an object


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Response):
    """The reply: `content` is null when the reply is only tool calls. A request with the legacy
    `functions` gets its call as `function_call`."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = _extension()
    function_call: FunctionCall | None = _extension()


class ChatChoice(_Response):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _extension()
    incomplete_details: IncompleteDetails | None = _extension()


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = _extension()


class DeltaFunctionCall(_Response):
    name: str | None = _extension()
    arguments: str | None = _extension()


class DeltaToolCall(_Response):
    """A streamed call: its first delta has `id`, `type` and the function's name, the next ones
    pieces of `arguments`, all under the call's `index` (as OpenAI's SDK joins them)."""

    index: int
    id: str | None = _extension()
    type: Literal["function"] | None = _extension()
    function: DeltaFunctionCall


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = _extension()
    function_call: DeltaFunctionCall | None = _extension()


class ChatChunkChoice(_Response):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _extension()
    incomplete_details: IncompleteDetails | None = _extension()


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = _extension()


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "loraplex"
    root: str
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
