"""The three dataset formats: a JSON line → an example → token ids with its loss mask.

Formats (one per file, detected from its first recognisable line):
- chat: `{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str, "weight"?: 0|1}],
  "tools"?: [...]}` (OpenAI's fine-tuning format); loss on assistant messages whose weight is not 0.
  With tools (training.chat_tools), an assistant message may carry `tool_calls` (its content then
  optional) and a `tool` message answers one by `tool_call_id`; the tools and the calls render
  through the base model's chat template (`tools=`), so the adapter learns to write its calls.
- completion: `{"prompt": str, "completion": str}`; loss on the completion and EOS.
- text: `{"text": str}`; loss on every token (continued pre-training).

Validation (training.validation) and the trainer (training.trainer) share this module, so a file
that validates is exactly the file that trains. No Django here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from training.chat_tools import check_tool_message, parse_tool_calls, parse_tools
from training.problems import Problem

CHAT = "chat"
COMPLETION = "completion"
TEXT = "text"
FORMATS = (CHAT, COMPLETION, TEXT)

ROLES = ("system", "user", "assistant", "tool")
MESSAGE_KEYS = frozenset({"role", "content", "weight", "name", "tool_calls", "tool_call_id"})
# A chat line's keys besides `messages` (OpenAI's; parallel_tool_calls changes nothing in training).
CHAT_KEYS = frozenset({"messages", "tools", "parallel_tool_calls"})
# Label value that the loss ignores (the convention of transformers' causal-LM heads).
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Example:
    """A parsed line. `messages` for chat, `prompt`/`completion` for completion, `text` for text."""

    format: str
    messages: tuple[dict[str, Any], ...] = ()
    tools: tuple[dict[str, Any], ...] = ()  # chat: OpenAI's tool objects, rendered by the template
    prompt: str = ""
    completion: str = ""
    text: str = ""


@dataclass(frozen=True)
class EncodedExample:
    input_ids: list[int]
    labels: list[int]
    # Tokens before truncation, and whether truncation cut it.
    full_length: int
    truncated: bool

    @property
    def num_trained_tokens(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE_INDEX)


class EncodingError(ValueError):
    """The base tokenizer cannot encode an example the way training needs (e.g. its chat template)."""


def load_json_line(raw: bytes) -> Any:
    """The decoded JSON value of one line; ValueError (with the reason) when it is not JSON."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"not valid UTF-8 (byte {error.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{error.msg} at column {error.colno}") from None


def detect_format(value: Any) -> str | None:
    """The format a JSON object's keys announce, or None when it announces none."""
    if not isinstance(value, dict):
        return None
    if "messages" in value:
        return CHAT
    if "prompt" in value or "completion" in value:
        return COMPLETION
    if "text" in value:
        return TEXT
    return None


def parse_example(value: Any, fmt: str) -> tuple[Example | None, list[Problem], list[Problem]]:
    """(example or None, errors, warnings) for one decoded JSON line of a file in format `fmt`."""
    if not isinstance(value, dict):
        return None, [Problem("data_type", f"Each line must be a JSON object, not {_json_type(value)}.")], []
    own = detect_format(value)
    if own is not None and own != fmt:
        return None, [Problem("mixed_formats", f"This line is in {own} format, but the file is in {fmt} "
                                               "format; use one format per file.")], []
    if fmt == CHAT:
        return _parse_chat(value)
    if fmt == COMPLETION:
        return _parse_completion(value)
    return _parse_text(value)


def _json_type(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _unused_keys(value: dict[str, Any], used: set[str]) -> list[Problem]:
    extra = sorted(set(value) - used)
    if not extra:
        return []
    return [Problem("unrecognized_key", f"Ignored key(s) {', '.join(repr(key) for key in extra)}.")]


def _parse_chat(value: dict[str, Any]) -> tuple[Example | None, list[Problem], list[Problem]]:
    messages = value.get("messages")
    if not isinstance(messages, list):
        return None, [Problem("missing_messages_list", "The line needs a 'messages' list.")], []
    if not messages:
        return None, [Problem("missing_messages_list", "The 'messages' list is empty.")], []
    errors: list[Problem] = []
    tools: tuple[dict[str, Any], ...] = ()
    if "tools" in value:
        tools, errors = parse_tools(value["tools"])
    call_ids: set[str] = set()
    trained_assistant = False
    parsed: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            errors.append(Problem("message_data_type", f"{where} must be an object, not {_json_type(message)}."))
            continue
        unknown = sorted(set(message) - MESSAGE_KEYS)
        if unknown:
            errors.append(Problem(
                "message_unrecognized_key",
                f"{where} has unrecognized key(s) {', '.join(repr(key) for key in unknown)}; allowed keys are "
                f"{', '.join(sorted(MESSAGE_KEYS))}.",
            ))
        role = message.get("role")
        if "role" not in message:
            errors.append(Problem("message_missing_key", f"{where} has no 'role'."))
        elif role not in ROLES:
            errors.append(Problem("unrecognized_role",
                                  f"{where} has role {role!r}; use one of {', '.join(ROLES)}."))
        content = message.get("content")
        calls: list[dict[str, Any]] = []
        if "tool_calls" in message:
            if role != "assistant":
                errors.append(Problem("invalid_tool_calls", f"{where} is a {role} message; only assistant messages "
                                                            "make tool calls."))
            else:
                calls, problems = parse_tool_calls(message["tool_calls"], where, tools, call_ids)
                errors.extend(problems)
        if "tool_call_id" in message and role != "tool":
            errors.append(Problem("invalid_tool_message", f"{where} has a tool_call_id but is not a tool message."))
        if role == "tool":
            errors.extend(check_tool_message(message, where, call_ids))
        elif not isinstance(content, str) and not ("tool_calls" in message and content is None):
            what = "has no 'content'" if "content" not in message else f"has content of type {_json_type(content)}"
            errors.append(Problem("missing_content", f"{where} {what}; content must be a string"
                                                     f"{' (or null beside tool_calls)' if role == 'assistant' else ''}."))
        weight = message.get("weight", 1)
        if "weight" in message and (role != "assistant" or weight not in (0, 1) or isinstance(weight, bool)):
            reason = "only assistant messages take a weight" if role != "assistant" else "weight must be 0 or 1"
            errors.append(Problem("invalid_weight", f"{where} has weight {weight!r}: {reason}."))
        if role == "assistant" and weight != 0:
            trained_assistant = True
        turn: dict[str, Any] = {"role": role, "content": content or "", "weight": weight}
        if calls:
            turn["tool_calls"] = calls
        if role == "tool":
            turn["tool_call_id"] = message.get("tool_call_id")
        parsed.append(turn)
    if not errors and not trained_assistant:
        errors.append(Problem("example_missing_assistant_message",
                              "The example has no assistant message to learn from (or all have weight 0)."))
    if errors:
        return None, errors, []
    return Example(format=CHAT, messages=tuple(parsed), tools=tools), [], _unused_keys(value, set(CHAT_KEYS))


def _parse_completion(value: dict[str, Any]) -> tuple[Example | None, list[Problem], list[Problem]]:
    errors = []
    for key in ("prompt", "completion"):
        if not isinstance(value.get(key), str):
            state = "is missing" if key not in value else f"is {_json_type(value[key])}"
            errors.append(Problem(f"missing_{key}", f"'{key}' {state}; it must be a string."))
    if not errors and not value["completion"]:
        errors.append(Problem("missing_completion", "'completion' is empty: there is nothing to learn."))
    if errors:
        return None, errors, []
    example = Example(format=COMPLETION, prompt=value["prompt"], completion=value["completion"])
    return example, [], _unused_keys(value, {"prompt", "completion"})


def _parse_text(value: dict[str, Any]) -> tuple[Example | None, list[Problem], list[Problem]]:
    text = value.get("text")
    if not isinstance(text, str) or not text:
        state = "is missing" if "text" not in value else ("is empty" if text == "" else f"is {_json_type(text)}")
        return None, [Problem("missing_text", f"'text' {state}; it must be a non-empty string.")], []
    return Example(format=TEXT, text=text), [], _unused_keys(value, {"text"})


def encode_example(example: Example, tokenizer: Any, max_seq_length: int | None = None) -> EncodedExample:
    """Token ids and labels (IGNORE_INDEX where no loss is taken), cut to max_seq_length."""
    if example.format == CHAT:
        ids, mask = _encode_chat(example.messages, example.tools, tokenizer)
    elif example.format == COMPLETION:
        prompt = tokenizer(example.prompt)["input_ids"]
        completion = tokenizer(example.completion, add_special_tokens=False)["input_ids"] + _eos(tokenizer)
        ids, mask = prompt + completion, [False] * len(prompt) + [True] * len(completion)
    else:
        ids = tokenizer(example.text)["input_ids"] + _eos(tokenizer)
        mask = [True] * len(ids)
    full_length = len(ids)
    if max_seq_length is not None and full_length > max_seq_length:
        ids, mask = ids[:max_seq_length], mask[:max_seq_length]
    labels = [token if trained else IGNORE_INDEX for token, trained in zip(ids, mask)]
    return EncodedExample(input_ids=ids, labels=labels, full_length=full_length,
                          truncated=max_seq_length is not None and full_length > max_seq_length)


def _eos(tokenizer: Any) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: tuple[dict[str, Any], ...], *,
            generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=list(tools) or None, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def _encode_chat(messages: tuple[dict[str, Any], ...], tools: tuple[dict[str, Any], ...],
                 tokenizer: Any) -> tuple[list[int], list[bool]]:
    """Encode with the base tokenizer's chat template; mark the trained assistant replies.

    Templates rarely mark assistant spans (`{% generation %}` is optional), so each reply's span is
    found by rendering the conversation up to it: the text the template adds after the generation
    prompt, up to the reply's end and the end-of-turn token right after it. Character spans map to
    tokens through the tokenizer's offsets, which works for any template that renders a prefix of
    a conversation as a prefix of the whole. A reply with tool calls ends at the end-of-turn token
    after its calls (they follow the content in every template's own format).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise EncodingError("The base model's tokenizer has no chat template, so chat datasets cannot be "
                            "trained on it; use the prompt/completion or text format.")
    plain = [{key: value for key, value in message.items() if key != "weight"} for message in messages]
    full = _render(tokenizer, plain, tools, generation_prompt=False)
    if tools and full == _render(tokenizer, plain, (), generation_prompt=False):
        raise EncodingError("The base model's chat template does not render tools, so examples with 'tools' "
                            "cannot teach it its functions.")
    spans: list[tuple[int, int]] = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or message["weight"] == 0:
            continue
        start = len(_render(tokenizer, plain[:index], tools, generation_prompt=True))
        upto = _render(tokenizer, plain[: index + 1], tools, generation_prompt=False)
        if not full.startswith(upto) or not upto.startswith(full[:start]):
            raise EncodingError("The base model's chat template does not render a conversation's beginning "
                                "as a prefix of the whole conversation, so replies cannot be located.")
        eos = tokenizer.eos_token
        if message.get("tool_calls"):
            spans.append((start, _calls_end(message, upto, start, eos)))
            continue
        content_at = full.find(message["content"], start) if message["content"] else start
        end = content_at + len(message["content"]) if content_at >= 0 else len(upto)
        if eos and full.startswith(eos, end):
            end += len(eos)
        spans.append((start, end))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    mask = [any(token_start < end and token_end > start for start, end in spans) and token_end > token_start
            for token_start, token_end in encoded["offset_mapping"]]
    return ids, mask


def _calls_end(message: dict[str, Any], upto: str, start: int, eos: str | None) -> int:
    """Where a reply with tool calls ends in `upto` (the conversation rendered up to it): after the
    end-of-turn token that follows its last call's name, else at the rendering's end."""
    last_name = message["tool_calls"][-1]["function"]["name"]
    named_at = upto.rfind(last_name, start)
    if named_at < 0:
        raise EncodingError("The base model's chat template does not render tool calls, so examples with "
                            "'tool_calls' cannot teach them.")
    eos_at = upto.find(eos, named_at) if eos else -1
    return eos_at + len(eos) if eos and eos_at >= 0 else len(upto.rstrip())
