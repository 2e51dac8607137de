"""Structured output: what a request's output must match, compiled to a grammar, and the per-token
masks that hold the sampler to it (xgrammar; docs/serving-worker.md, "Structured output", says why
this library).

A request names one constraint (``GuidedDecodingParams``, vLLM's fields: a JSON schema, any JSON
object, a regular expression, one of a list of strings, or an EBNF grammar). The engine compiles it
on ``GrammarCompiler``'s thread, never on the step, and keeps the result per constraint, so the
next request with the same schema starts at once. Each constrained sequence then holds a ``Guide``
(the grammar's matcher): before each sample its allowed tokens become a bitmask row
(``mask_logits``, the whole batch's rows in one call) and after it the chosen token advances it.
The end-of-sequence token is allowed only where the grammar is complete, so a finished output
always matches.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

# Compiled grammars kept per constraint: a tenant's few schemas are reused by every request, and a
# compiled grammar of a typical schema is a few hundred kilobytes at a 128k vocabulary.
_CACHE_SIZE = 256

# xgrammar is imported where it is first used: its import takes about 1.5 s, which an engine that
# serves no constraint (and every test that starts one) should not pay at start.

# xgrammar's messages start with "[hh:mm:ss] /project/cpp/file.cc:123: "; the caller needs the rest.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


class GrammarError(ValueError):
    """A constraint the grammar library cannot compile; the message names the construct."""


def library_detail(exc: Exception) -> str:
    """The grammar library's message for the caller (without its log line's prefix)."""
    return _LOG_PREFIX.sub("", str(exc).strip())


@dataclass(frozen=True)
class GuidedDecodingParams:
    """One constraint on a request's output, with vLLM's field names; exactly one is set.

    ``json``: a JSON schema (a dict, or its JSON text). ``json_object``: any JSON object.
    ``regex``: a regular expression the whole output matches. ``choice``: the output is one of
    these strings. ``grammar``: an EBNF grammar (GBNF's syntax, rule ``root`` first).
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(f"guided decoding takes exactly one of json, json_object, regex, choice, grammar; got {given or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"the JSON schema is not valid JSON: {exc}") from exc
            if not isinstance(schema, dict) and not isinstance(schema, bool):
                raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
            # One spelling per schema, so equal schemas share one compiled grammar.
            object.__setattr__(self, "json", json.dumps(schema, sort_keys=True, separators=(",", ":")))
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("a regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("a grammar must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the compiled grammar is cached under."""
        if self.json_object:
            return "json_object", ""
        if self.json is not None:
            assert isinstance(self.json, str)  # __post_init__ spells it as text
            return "json", self.json
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", "\x00".join(self.choice)
        assert self.grammar is not None
        return "grammar", self.grammar

    @property
    def kind(self) -> str:
        """What the caller sent, in words for an error: "JSON schema", "regex", …"""
        return {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
                "choice": "choice", "grammar": "grammar"}[self.key[0]]


# xgrammar 0.2.8 spells a length-bounded JSON string's character as [^"\\\r\n], which lets raw
# control characters (U+0000-U+001F) into the string: not JSON (RFC 8259), json.loads refuses it.
# Its unbounded strings exclude them; bounded ones are given the same class (no escapes, a subset).
_BOUNDED_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\]'


def json_schema_grammar(schema: str) -> str:
    """The EBNF grammar of compact JSON (no free whitespace) matching `schema`: a model that loops
    on spaces or newlines inside an object would otherwise run to max_tokens without closing it."""
    import xgrammar as xgr

    return str(xgr.Grammar.from_json_schema(schema, any_whitespace=False)).replace(_BOUNDED_STRING_CHAR,
                                                                                   _JSON_STRING_CHAR)


def _choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices`: each a JSON string literal, whose
    escapes xgrammar's EBNF string literals read the same way."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GrammarCompiler:
    """Compiles constraints for one tokenizer on its own thread, one future per constraint (a
    constraint asked again while compiling waits for the same compilation; a failed one fails
    again at once). ``on_done`` is called from that thread after each compilation, to wake an
    engine loop that waits for work."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, vocab_size: int, stop_token_ids: Collection[int],
                 on_done: Callable[[], None] = lambda: None) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._on_done = on_done
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future[xgrammar.CompiledGrammar]] = OrderedDict()
        # The tokenizer's table for the library takes seconds at a 128k vocabulary: built on the
        # thread once, by the first compilation, so an engine that serves no constraint never pays.
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)

    def compile(self, params: GuidedDecodingParams) -> Future[xgrammar.CompiledGrammar]:
        """The compiled grammar of `params`, as a future (done at once when cached)."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._executor.submit(self._compile, params)
            self._cache[key] = future
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda _: self._on_done())
        return future

    def _library(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                      stop_token_ids=self._stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def _compile(self, params: GuidedDecodingParams) -> xgrammar.CompiledGrammar:
        compiler = self._library()
        kind, text = params.key
        try:
            if kind == "json":
                return compiler.compile_grammar(json_schema_grammar(text))
            if kind == "json_object":
                return compiler.compile_grammar(json_schema_grammar('{"type": "object"}'))
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                assert params.choice is not None
                return compiler.compile_grammar(_choice_grammar(params.choice))
            return compiler.compile_grammar(text)
        except RuntimeError as exc:
            detail = library_detail(exc)
            raise GrammarError(f"the {params.kind} cannot be used for guided decoding: {detail}") from exc

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class Guide:
    """One sequence's position in its grammar."""

    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask`'s row `row`."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by the sampled `token`; False if the grammar does not allow it (which the mask
        prevents)."""
        return bool(self._matcher.accept_token(token))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was taken."""
        return bool(self._matcher.is_terminated())


def mask_logits(logits: torch.Tensor, guides: Sequence[Guide | None]) -> None:
    """Set every token a row's guide does not allow to -inf, in place; rows without one are left
    alone. One bitmask for the batch, filled on the host (the matchers live there) and applied to
    the constrained rows in one call."""
    import xgrammar as xgr

    rows = [i for i, guide in enumerate(guides) if guide is not None]
    if not rows:
        return
    bitmask = xgr.allocate_token_bitmask(len(guides), logits.shape[1])
    for i in rows:
        guide = guides[i]
        assert guide is not None
        guide.fill(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
