"""Structured output: what a request's output must match, compiled to a grammar, and the per-token
masks that hold the sampler to it (xgrammar; docs/serving-worker.md, "Structured output", says why
this library).

A request names one constraint (``GuidedDecodingParams``, vLLM's fields: a JSON schema, any JSON
object, a regular expression, one of a list of strings, or an EBNF grammar). ``GrammarCompiler``
checks it against the compile budget (``GrammarBudget``: nesting and size at once, time and
grammar size while compiling), compiles it in the engine's pool of compiling processes, whose queue
is fair between tenants (serving.engine.grammar_pool), never on the step, and keeps the result
per tenant, so the tenant's next request with the same schema starts at once and no tenant reads
another's cache (docs/security.md, "Grammar compilation"). Each constrained sequence then holds a
``Guide`` (the grammar's matcher): before each sample its allowed tokens become a bitmask row
(``mask_logits``, the whole batch's rows in one call) and after it the chosen token advances it.
The end-of-sequence token is allowed only where the grammar is complete, so a finished output
always matches.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from serving.engine.grammar_pool import GrammarBudget, GrammarError, GrammarPool, GrammarTooComplex
from serving.engine.grammar_worker import library_detail
from serving.engine.json_grammar import json_schema_grammar

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

__all__ = ["GrammarBudget", "GrammarCompiler", "GrammarError", "GrammarTooComplex", "Guide", "GuidedDecodingParams",
           "grammar_tenant", "json_schema_grammar", "library_detail", "mask_logits"]

# xgrammar is imported where it is first used: its import takes about 1.5 s, which an engine that
# serves no constraint (and every test that starts one) should not pay at start.

# What a failed compile costs in the cache (its message), for the bytes bound.
_ERROR_BYTES = 1024


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
            try:
                if isinstance(schema, str):
                    try:
                        schema = json.loads(schema)
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"the JSON schema is not valid JSON: {exc}") from exc
                if not isinstance(schema, dict) and not isinstance(schema, bool):
                    raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
                # One spelling per schema, so equal schemas share one compiled grammar.
                object.__setattr__(self, "json", json.dumps(schema, sort_keys=True, separators=(",", ":")))
            except RecursionError as exc:  # nested past the interpreter's stack: far past any budget
                raise GrammarTooComplex("the JSON schema nests too deeply to be read") from exc
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


def _choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices`: each a JSON string literal, whose
    escapes xgrammar's EBNF string literals read the same way."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def json_depth(value: Any) -> int:
    """How deeply `value` (parsed JSON) nests objects and arrays; iterative, so any depth is safe."""
    depth, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        depth = max(depth, level)
        stack.extend((child, level + 1) for child in children)
    return depth


def check_schema_budget(schema: Any, text_bytes: int, budget: GrammarBudget, what: str) -> None:
    """GrammarTooComplex when a JSON schema (parsed; `text_bytes` its JSON text's length) is past
    the budget's nesting or size: checked before any compiling, so the cost of a refusal is the
    schema's reading. `what` names it for the caller ("the JSON schema")."""
    if text_bytes > budget.max_constraint_bytes:
        raise GrammarTooComplex(f"{what} is {text_bytes:,} bytes; this worker compiles at most "
                                f"{budget.max_constraint_bytes:,}")
    depth = json_depth(schema)
    if depth > budget.max_schema_depth:
        raise GrammarTooComplex(f"{what} nests {depth} levels deep (in JSON); this worker compiles at most "
                                f"{budget.max_schema_depth}")


def check_budget(params: GuidedDecodingParams, budget: GrammarBudget) -> None:
    """GrammarTooComplex when `params` is past the budget's size or nesting (before it is queued)."""
    kind, text = params.key
    if kind == "json":
        check_schema_budget(json.loads(text), len(text.encode()), budget, f"the {params.kind}")
        return
    limit = budget.max_grammar_bytes if kind == "grammar" else budget.max_constraint_bytes
    size = len(text.encode())
    if size > limit:
        raise GrammarTooComplex(f"the {params.kind} is {size:,} bytes; this worker compiles at most {limit:,}")


def grammar_tenant(cache_salt: str | None, adapter_name: str | None) -> str:
    """Whose share of the compile pool and cache a request uses. The gateway salts every request's
    prefix cache with its tenant (serving.gateway.upstream: ``tenant-<id>``), so the salt is the
    isolation domain where there is one: grammars are shared exactly where cached prompts are.
    Without one (a direct call to the worker), an adapter's registry name
    ``<tenant>/<adapter>@<version>`` gives its tenant; anything else is the worker's own callers'."""
    if cache_salt:
        return f"salt:{cache_salt}"
    if adapter_name and "/" in adapter_name and "@" in adapter_name:
        return f"tenant:{adapter_name.split('/', 1)[0]}"
    return "local"


class TenantGrammarCache:
    """Compiled grammars (as futures, a failure cached as one) per tenant: at most ``entries`` a
    tenant (its least recently used go first), and at most ``max_bytes`` of settled ones in all;
    past that, the tenant holding the most bytes loses its least recently used, so one tenant's
    schemas evict its own entries before anyone else's. Not thread-safe (the compiler's lock)."""

    def __init__(self, entries: int, max_bytes: int) -> None:
        self._entries = entries
        self._max_bytes = max_bytes
        self._tenants: dict[str, OrderedDict[tuple[str, str], Future[Any]]] = {}
        self._sizes: dict[tuple[str, tuple[str, str]], int] = {}
        self._bytes: dict[str, int] = {}

    def get(self, tenant: str, key: tuple[str, str]) -> Future[Any] | None:
        entries = self._tenants.get(tenant)
        future = entries.get(key) if entries is not None else None
        if future is not None:
            assert entries is not None
            entries.move_to_end(key)
        return future

    def put(self, tenant: str, key: tuple[str, str], future: Future[Any]) -> None:
        entries = self._tenants.setdefault(tenant, OrderedDict())
        entries[key] = future
        while len(entries) > self._entries:
            self._evict(tenant)

    def settled(self, tenant: str, key: tuple[str, str], future: Future[Any], size: int) -> None:
        """`future` (cached under `key`) is done, its grammar `size` bytes: counted, and the
        largest holders' oldest evicted while the cache is over its bytes."""
        entries = self._tenants.get(tenant)
        if entries is None or entries.get(key) is not future:
            return  # evicted or dropped meanwhile
        self._sizes[(tenant, key)] = size
        self._bytes[tenant] = self._bytes.get(tenant, 0) + size
        while sum(self._bytes.values()) > self._max_bytes:
            self._evict(max(self._bytes, key=self._bytes.__getitem__))

    def drop(self, tenant: str, key: tuple[str, str], future: Future[Any]) -> None:
        entries = self._tenants.get(tenant)
        if entries is not None and entries.get(key) is future:
            self._remove(tenant, key)

    def keys(self, tenant: str) -> list[tuple[str, str]]:
        return list(self._tenants.get(tenant, ()))

    def _evict(self, tenant: str) -> None:
        self._remove(tenant, next(iter(self._tenants[tenant])))

    def _remove(self, tenant: str, key: tuple[str, str]) -> None:
        entries = self._tenants[tenant]
        del entries[key]
        size = self._sizes.pop((tenant, key), 0)
        if size:
            self._bytes[tenant] -= size
        if not entries:
            del self._tenants[tenant]
            self._bytes.pop(tenant, None)


class GrammarCompiler:
    """Compiles constraints for one tokenizer in a GrammarPool, one future per tenant and
    constraint (a constraint the same tenant asks again while compiling waits for the same
    compilation; a failed one fails again at once). ``release`` tells it a request waiting for a
    future left: when none waits any more, the compile is cancelled (its process killed). ``on_done``
    is called after each compilation settles, to wake an engine loop that waits for work."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, vocab_size: int, stop_token_ids: Collection[int],
                 budget: GrammarBudget | None = None, on_done: Callable[[], None] = lambda: None) -> None:
        self.budget = budget or GrammarBudget()
        self._lock = threading.Lock()
        self._cache = TenantGrammarCache(self.budget.cache_entries, self.budget.cache_bytes)
        # Futures still compiling: their tenant, key and how many requests wait for them.
        self._waiting: dict[Future[Any], tuple[str, tuple[str, str], int]] = {}
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self.pool = GrammarPool(self._tokenizer_info, self.budget, on_done=on_done)

    def _tokenizer_info(self) -> xgrammar.TokenizerInfo:
        # Seconds at a 128k vocabulary: built on the pool's thread, by the first compilation.
        import xgrammar as xgr

        return xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                  stop_token_ids=self._stop_token_ids)

    def compile(self, params: GuidedDecodingParams, tenant: str = "local") -> Future[xgrammar.CompiledGrammar]:
        """The compiled grammar of `params` for `tenant`, as a future (done at once when cached, or
        failed at once when past the budget's size or nesting). Each call is one waiter, ended by
        ``release`` if its request leaves before the future is done."""
        kind, text = params.key
        key = (kind, hashlib.sha256(text.encode()).hexdigest())
        with self._lock:
            future = self._cache.get(tenant, key)
            if future is not None:
                if future in self._waiting:
                    owner, cached_key, waiters = self._waiting[future]
                    self._waiting[future] = (owner, cached_key, waiters + 1)
                return future
            try:
                check_budget(params, self.budget)
            except GrammarTooComplex as exc:
                future = Future()
                future.set_exception(exc)
            else:
                if kind == "choice":
                    assert params.choice is not None
                    kind, text = "grammar", _choice_grammar(params.choice)
                future = self.pool.submit(tenant, kind, text, params.kind)
                self._waiting[future] = (tenant, key, 1)
            self._cache.put(tenant, key, future)
        future.add_done_callback(self._settled)
        return future

    def _settled(self, future: Future[Any]) -> None:
        with self._lock:
            entry = self._waiting.pop(future, None)
            if entry is None or future.cancelled():
                return
            tenant, key, _ = entry
            error = future.exception()
            self._cache.settled(tenant, key, future, _ERROR_BYTES if error else future.result().memory_size_bytes)

    def release(self, future: Future[Any]) -> None:
        """A request waiting for `future` left; the last one to leave cancels the compile."""
        with self._lock:
            entry = self._waiting.get(future)
            if entry is None:
                return  # done already
            tenant, key, waiters = entry
            if waiters > 1:
                self._waiting[future] = (tenant, key, waiters - 1)
                return
            del self._waiting[future]
            self._cache.drop(tenant, key, future)
        self.pool.cancel(future)

    def cached_keys(self, tenant: str) -> list[tuple[str, str]]:
        """(kind, sha256 of the text) of `tenant`'s cached grammars, least recently used first."""
        with self._lock:
            return self._cache.keys(tenant)

    def shutdown(self) -> None:
        self.pool.close()


class Guide:
    """One sequence's position in its grammar."""

    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        # The last mask allowed no token: the grammar cannot be completed from here (a rule that
        # needs itself first, reached after some text); whatever is sampled is then refused.
        self.dead_end = False

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask`'s row `row`."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        self.dead_end = not bool(bitmask[row].any())

    def refusal(self, token: int) -> Exception:
        """Why `token`, which ``accept`` refused, ends the sequence: the caller's grammar when it
        allowed nothing (a 400 naming its field), else an engine bug (the mask allows only what the
        grammar accepts)."""
        if self.dead_end:
            return GrammarError("the grammar cannot be used for guided decoding: after the text generated so far it "
                                "allows no token and cannot end (a rule that needs itself before any text)")
        return RuntimeError(f"token {token} was sampled outside the request's grammar")

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
