"""What the gateway takes from a caller's completion request: the body decoded and checked once,
the allow-list of fields forwarded to a serving worker, the `max_tokens` asked and the prompt's
estimated size.

- The body must be UTF-8 JSON whose strings are all encodable: JSON lets a string hold a lone
  surrogate (`"\\ud800"`), which Python decodes into a `str` that no UTF-8 encoder accepts (the
  database, the hash of `user`, the worker's request would each fail with a 500). Refused here,
  once, with a 400 naming the field; the walk over the body only runs when the text holds a
  surrogate escape at all, so ordinary requests pay one substring search.
- No `NaN`/`Infinity` and no nesting deeper than the bound (the gateway's own `json.dumps` of the
  worker's request refuses a NaN: it was a 500, counted against the worker), and every field whose
  size sets the request's work within its cap (`model` at most MODEL_MAX_CHARS characters, `stop`,
  `tools`, `logit_bias`, the structured-output texts, …): serving.contracts.request_caps, the bounds the
  worker checks too. All of it before any token bucket, lookup or queue.
- Fields named `loraplex_*` are the workers' internal protocol (`loraplex_adapter` makes a
  worker load an artifact): a caller sending one gets a 400 naming it.
- The worker's request is built from FORWARDED only: the OpenAI (and vLLM-extension) fields the
  worker accepts (serving/contracts/protocol.py). Anything else a client sends (`user`,
  `metadata`, `store`, …) is dropped, as OpenAI and vLLM ignore fields they do not use; the
  gateway writes `model`, `max_tokens`, `priority` and `loraplex_adapter` itself.
"""

from __future__ import annotations

import math
import re
from typing import Any

from serving.gateway.errors import GatewayError, invalid_request
from serving.contracts import request_caps

MODEL_MAX_CHARS = request_caps.MAX_MODEL_CHARS
INTERNAL_PREFIX = "loraplex_"

# SamplingFields of the worker's protocol, less those the gateway writes itself.
_SAMPLING = frozenset({
    "temperature", "top_p", "top_k", "stop", "seed", "stream", "stream_options", "ignore_eos", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "return_token_ids",
    # n completions a prompt, OpenAI's penalties and logit_bias, vLLM's repetition_penalty and min_tokens.
    "n", "presence_penalty", "frequency_penalty", "logit_bias", "repetition_penalty", "min_tokens",
    # Structured output (vLLM's names), on both endpoints.
    "guided_json", "guided_regex", "guided_choice", "guided_grammar",
})
FORWARDED: dict[str, frozenset[str]] = {
    "completions": _SAMPLING | {"prompt", "logprobs", "echo", "suffix", "best_of"},
    "chat": _SAMPLING | {"messages", "logprobs", "top_logprobs", "add_generation_prompt", "continue_final_message",
                         "chat_template_kwargs", "chat_template", "response_format",
                         # Tools (OpenAI's, and the legacy functions).
                         "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"},
}

# A `\uD800`-`\uDFFF` escape (either case): the only way a surrogate gets into UTF-8 JSON text.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def decode_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object; 400 for a body that is not UTF-8, not JSON, not an object, or
    holds a lone surrogate, an internal field, no usable `model`, or a field over its cap."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid_request(f"The request body is not valid UTF-8 (byte {exc.start}).") from None
    try:
        body = request_caps.loads(text or "null")
    except request_caps.CapExceeded as exc:
        raise _refusal(exc) from None
    except ValueError as exc:
        raise invalid_request(f"The request body is not valid JSON: {exc}.") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    if "\\u" in text and _SURROGATE_ESCAPE.search(text):
        _refuse_surrogates(body, "")
    for name in body:
        if name.startswith(INTERNAL_PREFIX):
            raise invalid_request(f"'{name}' is an internal field of Loraplex's serving workers; the public API does "
                                  "not accept it. Remove it from the request.", param=name, code="internal_field")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_request("'model' is required: an adapter name, 'name@version', or the base model's id.",
                              param="model")
    # The gateway reads these two itself (to relay a stream and ask for its usage), so their types
    # are its business: `"stream_options": [1]` made building the worker's request raise, a 500.
    stream, options = body.get("stream"), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise invalid_request(f"'stream' must be true or false, got {stream!r:.40}.", param="stream")
    if options is not None and not isinstance(options, dict):
        raise invalid_request("'stream_options' must be an object, such as {\"include_usage\": true}.",
                              param="stream_options")
    try:
        request_caps.check_caps(body)
    except request_caps.CapExceeded as exc:
        raise _refusal(exc) from None
    return body


def _refusal(exc: request_caps.CapExceeded) -> GatewayError:
    return invalid_request(exc.message, param=exc.param, code=exc.code)


def _refuse_surrogates(value: Any, path: str) -> None:
    """400 naming the first string (key or value) at or under `path` that holds a surrogate."""
    if isinstance(value, str):
        if _SURROGATE.search(value):
            raise invalid_request(f"'{path or 'body'}' holds a lone UTF-16 surrogate (such as \\ud800), which is not "
                                  "valid Unicode text; send each character as itself or as a surrogate pair.",
                                  param=path or None, code="invalid_unicode")
    elif isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if _SURROGATE.search(key):
                _refuse_surrogates(key, f"{path}.<key>" if path else "<key>")
            _refuse_surrogates(item, where)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _refuse_surrogates(item, f"{path}[{index}]")


def forwarded(body: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """The caller's fields the worker gets (FORWARDED for the endpoint), in the caller's order."""
    allowed = FORWARDED[endpoint]
    return {name: value for name, value in body.items() if name in allowed}


# A rough token count of text before the worker tokenizes it (≈ 4 bytes a token for BPE
# vocabularies); the reservation is corrected with the worker's real usage when the request ends.
_BYTES_PER_TOKEN = 4
_TOKENS_PER_MESSAGE = 4


def requested_max_tokens(body: dict[str, Any], endpoint: str) -> int | None:
    names = ("max_completion_tokens", "max_tokens") if endpoint == "chat" else ("max_tokens",)
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise invalid_request(f"'{name}' must be a positive integer, got {value!r}.", param=name)
        return value
    return None


def requested_sequences(body: dict[str, Any], endpoint: str) -> int:
    """How many completions the request can generate: one per prompt of a completions list, times
    its ``best_of`` (the sequences generated) or ``n``. The tier's per-request token limit and the
    bucket's reservation cover all of them."""
    per_prompt = 1
    for name in ("best_of", "n"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise invalid_request(f"'{name}' must be a positive integer, got {value!r}.", param=name)
        per_prompt = max(per_prompt, value)
    prompt = body.get("prompt") if endpoint == "completions" else None
    prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    return prompts * per_prompt


def estimate_prompt_tokens(body: dict[str, Any], endpoint: str) -> int:
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return 0
        total = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):  # the worker refuses parts that are not text; none counts here
                content = "".join(text for part in content if isinstance(part, dict)
                                  and isinstance(text := part.get("text"), str))
            total += _TOKENS_PER_MESSAGE + math.ceil(len(str(content or "").encode()) / _BYTES_PER_TOKEN)
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if prompt and all(isinstance(item, int) for item in prompt):
            return len(prompt)
        return sum(len(item) if isinstance(item, list) else math.ceil(len(str(item).encode()) / _BYTES_PER_TOKEN)
                   for item in prompt)
    return math.ceil(len(str(prompt or "").encode()) / _BYTES_PER_TOKEN)
