"""The bounds on a completion request's shape, written once and checked by both the gateway
(serving.gateway.request_fields) and the serving worker (serving.engine.server.body_json) before the
request is queued, so a caller cannot buy unbounded work with one request.

`loads` decodes a body as JSON with two refusals the standard decoder lacks: numbers that are not
finite (`NaN`, `Infinity`, `-Infinity`, or a literal such as `1e400` that overflows to infinity;
JSON itself has none, Python's decoder accepts them, and a NaN temperature then fails far from
where it came in) and nesting deeper than MAX_JSON_DEPTH (the decoder recurses, and a 100,000-deep
body raised RecursionError: a 500). The depth is measured on the text before decoding, without
recursion. `check_caps` then bounds each field whose size sets the work the request causes
(docs/security.md, "Request caps", has each value and why). A refusal is a `CapExceeded` naming
the field (`param`), which each side turns into its 400 in OpenAI's shape.

Only sizes are checked here; a field of the wrong type is left to each side's own validation.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Callable
from itertools import accumulate
from typing import Any, Final

# The whole body's nesting, objects and arrays alike (the body itself is level 1). A chat request
# with tools or a schema nests 10-20 levels; a JSON schema of 30 nested properties still fits.
MAX_JSON_DEPTH: Final = 64
# An adapter name is at most 63 characters and a version 64: `name@version` fits in 128.
MAX_MODEL_CHARS: Final = 256
# OpenAI allows 4 stop strings; vLLM no bound. Each is matched against every step's new text.
MAX_STOP_STRINGS: Final = 16
MAX_STOP_CHARS: Final = 256
MAX_STOP_TOKEN_IDS: Final = 128
# OpenAI's own bound on logit_bias.
MAX_LOGIT_BIAS: Final = 300
# OpenAI's own bound on tools (and so on the legacy functions); each function's parameters schema,
# as compact JSON text, is bounded too: it becomes a grammar when the reply must be a call.
MAX_TOOLS: Final = 128
MAX_TOOL_SCHEMA_CHARS: Final = 32_768
# Structured output: the text each constraint is compiled from (serving.engine.guided).
MAX_GUIDED_CHOICES: Final = 256
MAX_GUIDED_CHOICE_CHARS: Final = 1_024
MAX_GUIDED_REGEX_CHARS: Final = 8_192
MAX_GUIDED_GRAMMAR_CHARS: Final = 32_768
MAX_JSON_SCHEMA_CHARS: Final = 65_536
# OpenAI's bounds on the top alternatives returned per token (completions' logprobs, chat's top_logprobs).
MAX_LOGPROBS: Final = 20

NESTING_TOO_DEEP: Final = "nesting_too_deep"
NON_FINITE_NUMBER: Final = "non_finite_number"
LIMIT_EXCEEDED: Final = "request_limit_exceeded"
MODEL_NAME_TOO_LONG: Final = "model_name_too_long"


class CapExceeded(ValueError):
    """A request over one of the bounds: `message` for the caller, `param` the field, `code` OpenAI's."""

    def __init__(self, message: str, *, param: str | None, code: str = LIMIT_EXCEEDED) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


# Brackets as bytes.translate keeps them: an opener is +1, a closer -1 (0xff, as a signed byte);
# every other byte is deleted.
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")


def too_deep(text: str, bound: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON `text` nests arrays and objects deeper than `bound`: the highest running
    count of open brackets outside strings. No recursion and no per-character Python: escaped
    backslashes and quotes dropped, so every other `"` opens or closes a string; the text outside
    strings; its brackets as +1/-1 bytes; their running sum's maximum, all in C (about 40 ms for a
    megabyte of brackets on the 2-core machine)."""
    if text.count("[") + text.count("{") <= bound:
        return False
    outside = "".join(text.replace("\\\\", "").replace('\\"', "").split('"')[0::2])
    steps = array("b", outside.encode("utf-8", "surrogatepass").translate(_STEPS, _NOT_BRACKETS))
    return max(accumulate(steps), default=0) > bound


class _NonFinite:
    """Stands in for a non-finite number while decoding, so its field can be named afterwards."""


_NON_FINITE = _NonFinite()


def loads(raw: str | bytes) -> Any:
    """`raw` decoded as JSON (bytes in any encoding json.loads detects); CapExceeded for nesting
    deeper than MAX_JSON_DEPTH or a number that is not finite; json.JSONDecodeError (a ValueError)
    for text that is not JSON."""
    text = raw.decode(json.detect_encoding(raw), "surrogatepass") if isinstance(raw, bytes) else raw
    if too_deep(text):
        raise _deep("The request body")
    seen: list[str] = []

    def constant(name: str) -> _NonFinite:
        seen.append(name)
        return _NON_FINITE

    def finite_float(literal: str) -> float | _NonFinite:
        number = float(literal)
        if math.isfinite(number):
            return number
        seen.append(f"{literal[:32]} (beyond a 64-bit float)")
        return _NON_FINITE

    try:
        value = json.loads(text, parse_constant=constant, parse_float=finite_float)
    except RecursionError:  # a safety net only: too_deep follows the decoder's nesting, so this deep was refused above
        raise _deep("The request body") from None
    if seen:  # the walk to name the field runs only for a body being refused
        where = _path_of(value, _NON_FINITE) or ""
        raise CapExceeded(f"'{where or 'body'}' is {seen[0]}: JSON numbers must be finite (NaN, Infinity and "
                          "-Infinity are not JSON).", param=where or None, code=NON_FINITE_NUMBER)
    return value


def _deep(what: str, param: str | None = None) -> CapExceeded:
    return CapExceeded(f"{what} nests arrays and objects more than {MAX_JSON_DEPTH} levels deep; this API accepts "
                       f"at most {MAX_JSON_DEPTH}.", param=param, code=NESTING_TOO_DEEP)


def _path_of(value: Any, target: object) -> str | None:
    """The field path (`a.b[2]`) of `target` in `value`, or None; iterative (the depth is bounded
    already, but a walk needs no recursion to stay cheap)."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if item is target:
            return path
        if isinstance(item, dict):
            stack.extend((child, f"{path}.{key}" if path else str(key)) for key, child in item.items())
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{index}]") for index, child in enumerate(item))
    return None


def _over(param: str, what: str, bound: int, code: str = LIMIT_EXCEEDED) -> CapExceeded:
    """`what`: the size as found ("holds 95000 strings"); the bound is in the same unit."""
    return CapExceeded(f"'{param}' {what}; this API accepts at most {bound}.", param=param, code=code)


def _count(body: dict[str, Any], name: str, bound: int, noun: str) -> None:
    value = body.get(name)
    if isinstance(value, (list, dict)) and len(value) > bound:
        raise _over(name, f"holds {len(value)} {noun}", bound)


def _chars(value: Any, param: str, bound: int, code: str = LIMIT_EXCEEDED, *, item: int | None = None) -> None:
    """`item`: the index of `value` in the list `param` (named in the message)."""
    if isinstance(value, str) and len(value) > bound:
        where = param if item is None else f"{param}[{item}]"
        error = _over(where, f"is {len(value)} characters long", bound, code)
        error.param = param
        raise error


def _schema_chars(schema: Any, param: str, bound: int) -> None:
    """A JSON schema (an object, or its JSON text) at most `bound` characters of compact JSON."""
    if isinstance(schema, str):
        _chars(schema, param, bound)
        if too_deep(schema):
            raise _deep(f"'{param}'", param)
    elif isinstance(schema, dict):
        size = len(json.dumps(schema, separators=(",", ":")))
        if size > bound:
            raise _over(param, f"is a schema of {size} characters as compact JSON", bound)


def _stop(body: dict[str, Any]) -> None:
    stop = body.get("stop")
    if isinstance(stop, str):
        _chars(stop, "stop", MAX_STOP_CHARS)
    elif isinstance(stop, list):
        if len(stop) > MAX_STOP_STRINGS:
            raise _over("stop", f"holds {len(stop)} strings", MAX_STOP_STRINGS)
        for index, item in enumerate(stop):
            _chars(item, "stop", MAX_STOP_CHARS, item=index)


def _tools(body: dict[str, Any]) -> None:
    for name in ("tools", "functions"):
        _count(body, name, MAX_TOOLS, "tools" if name == "tools" else "functions")
        items = body.get(name)
        for index, item in enumerate(items if isinstance(items, list) else []):
            function = item.get("function") if name == "tools" and isinstance(item, dict) else item
            if isinstance(function, dict):
                where = f"{name}[{index}].function.parameters" if name == "tools" else f"{name}[{index}].parameters"
                _schema_chars(function.get("parameters"), where, MAX_TOOL_SCHEMA_CHARS)


def _guided(body: dict[str, Any]) -> None:
    choices = body.get("guided_choice")
    if isinstance(choices, list):
        _count(body, "guided_choice", MAX_GUIDED_CHOICES, "choices")
        for index, item in enumerate(choices):
            _chars(item, "guided_choice", MAX_GUIDED_CHOICE_CHARS, item=index)
    _chars(body.get("guided_regex"), "guided_regex", MAX_GUIDED_REGEX_CHARS)
    _chars(body.get("guided_grammar"), "guided_grammar", MAX_GUIDED_GRAMMAR_CHARS)
    _schema_chars(body.get("guided_json"), "guided_json", MAX_JSON_SCHEMA_CHARS)
    fmt = body.get("response_format")
    spec = fmt.get("json_schema") if isinstance(fmt, dict) else None
    if isinstance(spec, dict):
        _schema_chars(spec.get("schema"), "response_format.json_schema.schema", MAX_JSON_SCHEMA_CHARS)


_CHECKS: tuple[Callable[[dict[str, Any]], None], ...] = (
    lambda body: _chars(body.get("model"), "model", MAX_MODEL_CHARS, MODEL_NAME_TOO_LONG),
    _stop,
    lambda body: _count(body, "stop_token_ids", MAX_STOP_TOKEN_IDS, "token ids"),
    lambda body: _count(body, "logit_bias", MAX_LOGIT_BIAS, "entries"),
    _tools,
    _guided,
)


def check_caps(body: dict[str, Any]) -> None:
    """CapExceeded naming the first field of a decoded request body over its bound."""
    for check in _CHECKS:
        check(body)
