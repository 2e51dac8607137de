"""Tool calls out of a model's text, per model family: Hermes / Qwen2.5 (`<tool_call>{json}</tool_call>`),
Llama 3.x (the reply is `{"name": …, "parameters": …}`, several joined by `;`) and Mistral
(`[TOOL_CALLS][{…}, …]`, the marker optional at the start, as `skip_special_tokens` drops it).

One incremental parser (`ToolCallParser`) serves streams and whole replies, so a streamed reply
reassembles to exactly the whole one: text is fed as it comes; content is released up to where a
call could begin (a partial marker and trailing whitespace are held back); each call is announced
once its name is known and its arguments have begun, then its arguments follow as the model writes
them (the raw JSON text of the value, so fragments only ever append). A whole reply is the same
parser fed the whole text; when its calls turn out malformed (unclosed, no name, arguments that are
not a JSON object, text between calls that the family does not write) the reply is all content.
A stream cannot take back a call it announced: there the malformed rest ends the call as it stands.

`family_for` picks the family: the worker's `--tool-call-parser`, or by default the marker the
chat template writes, and for a template that writes none of them the generic family (Hermes'
tagged blocks, which the worker's own tool prompt asks for: tool_prompt.py). `reads_tools` says
whether a template renders a request's tools at all (docs/serving-worker.md, "Tools";
docs/tools-and-structured-output.md).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class Family:
    """How one model family writes tool calls. `opening` is the text that opens the calls anywhere
    in a reply (None: calls only open a reply); `leading` are texts that may open a reply's calls
    when the calls are the whole reply. `before`, `between` and `after` match what the family writes
    before the first call object, between two and after the last (the last may be followed by
    anything where `after` is None)."""

    name: str
    args_key: str
    opening: str | None
    leading: tuple[str, ...]
    before: re.Pattern[str]
    between: re.Pattern[str]
    after: re.Pattern[str] | None
    # What a grammar (tool_grammar.py) writes around each call object, between two calls, and
    # before and after them all.
    grammar_open: str
    grammar_separator: str
    grammar_close: str
    grammar_prefix: str = ""
    grammar_suffix: str = ""


HERMES = Family(
    name="hermes", args_key="arguments", opening="<tool_call>", leading=(),
    before=re.compile(r"<tool_call>\s*"), between=re.compile(r"\s*</tool_call>\s*<tool_call>\s*"), after=None,
    grammar_open="<tool_call>\n", grammar_separator="\n", grammar_close="\n</tool_call>",
)
LLAMA3_JSON = Family(
    name="llama3_json", args_key="parameters", opening=None, leading=("<|python_tag|>", "{"),
    before=re.compile(r"(<\|python_tag\|>)?\s*"), between=re.compile(r"\s*;\s*"), after=re.compile(r"\s*"),
    grammar_open="", grammar_separator="; ", grammar_close="",
)
MISTRAL = Family(
    name="mistral", args_key="arguments", opening="[TOOL_CALLS]", leading=("[",),
    before=re.compile(r"(\[TOOL_CALLS\])?\s*\[\s*"), between=re.compile(r"\s*,\s*"), after=re.compile(r"\s*\]\s*"),
    # [TOOL_CALLS] is a special token a grammar cannot write (and the text drops): the array alone.
    grammar_open="", grammar_separator=", ", grammar_close="", grammar_prefix="[", grammar_suffix="]",
)
# For a template that writes no tool format this module reads: the worker's own tool prompt
# (tool_prompt.py) asks for Hermes' tagged blocks, the form most open models have seen, and the
# tags keep a call apart from a reply that merely holds JSON.
GENERIC = replace(HERMES, name="generic")
FAMILIES = {family.name: family for family in (HERMES, LLAMA3_JSON, MISTRAL, GENERIC)}
PARSER_CHOICES = ("auto", *FAMILIES, "none")
# A template that renders a request's tools reads the variable `tools` (Hugging Face's convention).
_READS_TOOLS = re.compile(r"\btools\b")


def family_for(choice: str, chat_template: str | None) -> Family | None:
    """The family `--tool-call-parser` names; for "auto", the one whose marker the template writes,
    else GENERIC. None: the operator turned tool calls off ("none")."""
    if choice == "none":
        return None
    if choice != "auto":
        return FAMILIES[choice]
    template = chat_template or ""
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or ('"parameters": ' in template and "<|start_header_id|>" in template):
        return LLAMA3_JSON
    return GENERIC


def reads_tools(chat_template: str | None) -> bool:
    """The template renders a request's tools (it reads the `tools` variable)."""
    return bool(_READS_TOOLS.search(chat_template or ""))


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # the JSON text of an object


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class Arguments:
    index: int
    text: str


Event = Content | CallStart | Arguments


@dataclass(frozen=True)
class Parsed:
    content: str | None
    calls: tuple[Call, ...]


def parse(family: Family, text: str, *, parallel: bool = True) -> Parsed:
    """The calls of a whole reply and the content before them; all content when they are malformed."""
    parser = ToolCallParser(family, parallel=parallel)
    events = [*parser.feed(text), *parser.finish()]
    if not parser.valid:
        return Parsed(content=text, calls=())
    content = "".join(event.text for event in events if isinstance(event, Content))
    return Parsed(content=content or None, calls=parser.calls())


class _ObjectScan:
    """A JSON object read as it is written, from its `{`: where it ends, its `name` (a string) and
    where its arguments' value starts and ends. `error` is set at the first character that cannot
    continue an object."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.pos = start
        self.end: int | None = None
        self.error = False
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.args_is_string = False
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect = "open"  # at depth 1: key, colon, value, comma
        self._key: str | None = None
        self._token_start = 0
        self._value_depth = 0

    def feed(self, text: str) -> None:
        """Read `text` from where the last call stopped (text only ever grows)."""
        while self.pos < len(text) and self.end is None and not self.error:
            self._step(text, self.pos, text[self.pos])
            self.pos += 1

    def _step(self, text: str, i: int, char: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
                if self._depth == 1:
                    self._string_closed(text, i)
            return
        if self._expect == "open":
            if char != "{":
                self.error = True
            self._depth, self._expect = 1, "key"
            return
        if self._depth > 1:  # inside a nested value: only its nesting and strings matter
            if char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 1:
                    self._value_closed(text, i + 1)
            return
        if char.isspace():
            return
        if self._expect == "key":
            if char == '"':
                self._in_string, self._token_start = True, i
            elif char == "}" and self._key is None:
                self._close(i)
            else:
                self.error = True
        elif self._expect == "colon":
            self._expect = "value" if char == ":" else self._fail()
        elif self._expect == "value":
            self._token_start = i
            if self._key in ARGUMENT_KEYS and self.args_start is None:
                self.args_start, self.args_is_string = i, char == '"'
            if char == '"':
                self._in_string, self._expect = True, "string value"
            elif char in "{[":
                self._depth, self._expect = 2, "comma"
            else:
                self._expect = "primitive"
        elif self._expect == "primitive":
            if char in ",}":
                self._value_closed(text, len(text[:i].rstrip()))
                self._after_value(char, i)
        elif self._expect == "comma":
            self._after_value(char, i)

    def _fail(self) -> str:
        self.error = True
        return "error"

    def _string_closed(self, text: str, i: int) -> None:
        raw = text[self._token_start:i + 1]
        if self._expect == "key":
            self._key, self._expect = json.loads(raw), "colon"
        else:
            if self._key == "name" and self.name is None:
                self.name = json.loads(raw)
            self._value_closed(text, i + 1)
            self._expect = "comma"

    def _value_closed(self, text: str, end: int) -> None:
        if self._key in ARGUMENT_KEYS and self.args_start is not None and self.args_end is None:
            self.args_end = end

    def _after_value(self, char: str, i: int) -> None:
        if char == ",":
            self._expect = "key"
        elif char == "}":
            self._close(i)
        else:
            self.error = True

    def _close(self, i: int) -> None:
        self._depth, self.end = 0, i + 1


@dataclass
class _CallState:
    scan: _ObjectScan
    announced: bool = False
    args_sent: int = 0  # characters of the arguments' text sent


@dataclass
class ToolCallParser:
    """Feeds on a reply's text; yields content and calls as events (module docstring)."""

    family: Family
    parallel: bool = True
    text: str = ""
    valid: bool = True
    _content_sent: int = 0
    _calls_at: int | None = None
    _calls: list[_CallState] = field(default_factory=list)
    _over: bool = False  # past the last call: the rest is the family's closing text

    def feed(self, delta: str) -> list[Event]:
        self.text += delta
        events: list[Event] = []
        if self._calls_at is None:
            content_end, self._calls_at = self._split()
            if self._calls_at is not None:
                content_end = len(self.text[:self._calls_at].rstrip())
            if content_end > self._content_sent:
                events.append(Content(self.text[self._content_sent:content_end]))
                self._content_sent = content_end
        if self._calls_at is not None:
            self._scan_calls(events)
        return events

    def finish(self) -> list[Event]:
        """The last events once the reply is complete; sets `valid`."""
        events: list[Event] = []
        if self._calls_at is None:
            if len(self.text) > self._content_sent:
                events.append(Content(self.text[self._content_sent:]))
            self._content_sent = len(self.text)
            return events
        self.valid = self._well_formed()
        for index, call in enumerate(self._calls):
            if call.scan.name is not None and call.scan.args_end is not None and not call.announced:
                call.announced = True
                events.append(CallStart(index, call.scan.name))
            if call.announced:
                self._send_arguments(index, call, events, final=True)
        if not self.valid and not any(call.announced for call in self._calls):
            # Nothing was announced: the held text is content after all.
            events.append(Content(self.text[self._content_sent:]))
            self._content_sent = len(self.text)
        return events

    def calls(self) -> tuple[Call, ...]:
        """The calls of a reply that finished well formed."""
        return tuple(Call(call.scan.name or "", self._arguments(call.scan)) for call in self._calls)

    @property
    def called(self) -> bool:
        return any(call.announced for call in self._calls)

    def _split(self) -> tuple[int, int | None]:
        """(content that can be sent, where the calls begin or None)."""
        text, family = self.text, self.family
        if family.opening is not None:
            at = text.find(family.opening)
            if at >= 0:
                return at, at
        stripped = text.lstrip()
        if family.leading and (not stripped or any(_prefix_of(stripped, lead) for lead in family.leading)):
            opener = next((lead for lead in family.leading if stripped.startswith(lead)), None)
            if opener is None:
                return 0, None  # it may yet open calls
            if opener != "[" or _opens_array_of_objects(stripped):
                return 0, len(text) - len(stripped)
            if stripped[1:].strip() == "":
                return 0, None
        held = _partial_suffix(text, family.opening) if family.opening else 0
        return len(text[:len(text) - held].rstrip()), None

    def _scan_calls(self, events: list[Event]) -> None:
        assert self._calls_at is not None
        while not self._over:
            if self._calls and self._calls[-1].scan.end is None:
                call = self._calls[-1]
                call.scan.feed(self.text)
                self._announce(len(self._calls) - 1, call, events)
                if call.scan.end is None or call.scan.error:
                    return
                if not self.parallel:
                    self._over = True
                continue
            after = self._calls[-1].scan.end if self._calls else self._calls_at
            assert after is not None
            brace = self.text.find("{", after)
            if brace < 0:
                return
            separator = self.family.between if self._calls else self.family.before
            if not separator.fullmatch(self.text, after, brace):
                self._over = True  # the calls ended; what follows is checked by finish()
                return
            self._calls.append(_CallState(_ObjectScan(brace)))

    def _announce(self, index: int, call: _CallState, events: list[Event]) -> None:
        scan = call.scan
        if not call.announced and scan.name is not None and scan.args_start is not None and not scan.args_is_string:
            call.announced = True
            events.append(CallStart(index, scan.name))
        if call.announced:
            self._send_arguments(index, call, events, final=False)

    def _send_arguments(self, index: int, call: _CallState, events: list[Event], *, final: bool) -> None:
        scan = call.scan
        if scan.args_start is None:
            return
        if scan.args_is_string:
            if not final or scan.args_end is None:
                return
            text = self._arguments(scan)
        else:
            end = scan.args_end if scan.args_end is not None else scan.pos
            text = self.text[scan.args_start:end]
        if len(text) > call.args_sent:
            events.append(Arguments(index, text[call.args_sent:]))
            call.args_sent = len(text)

    def _arguments(self, scan: _ObjectScan) -> str:
        assert scan.args_start is not None and scan.args_end is not None
        raw = self.text[scan.args_start:scan.args_end]
        return str(json.loads(raw)) if scan.args_is_string else raw

    def _well_formed(self) -> bool:
        if not self._calls:
            return False
        for call in self._calls:
            scan = call.scan
            if scan.error or scan.end is None or not isinstance(scan.name, str) or scan.args_end is None:
                return False
            try:
                json.loads(self.text[scan.start:scan.end])
                arguments = json.loads(self._arguments(scan))
            except (ValueError, TypeError):
                return False
            if not isinstance(arguments, dict):
                return False
        last = self._calls[-1].scan.end
        assert last is not None
        if self.parallel or self.family.after is None:
            return self.family.after is None or bool(self.family.after.fullmatch(self.text, last))
        # One call asked for: what follows it is the family's closing text up to any further call.
        return bool(self.family.after.match(self.text, last))


def _prefix_of(text: str, marker: str) -> bool:
    """`text` starts with `marker`, or is a beginning of it."""
    return text.startswith(marker) or marker.startswith(text)


def _opens_array_of_objects(text: str) -> bool:
    return text.startswith("[") and text[1:].lstrip().startswith("{")


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back: it may become one)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
