"""How to pick each next token and when to stop: vLLM's ``SamplingParams``, the fields this engine
implements, with the same names, defaults and meanings."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

from serving.engine.guided import GuidedDecodingParams
from serving.engine.stop_strings import StopStrings

_GREEDY_EPS = 1e-5
# OpenAI's bound on a logit bias; a larger one is clamped to it (it already bans or forces the token).
MAX_LOGIT_BIAS = 100.0


@dataclass
class SamplingParams:
    """Per-request sampling settings.

    ``temperature == 0`` is greedy. ``top_k`` of 0 or -1 and ``top_p`` of 1 disable those filters.
    ``seed`` gives the request its own random generator, so its samples do not depend on what else
    is in the batch. ``logprobs=k`` returns the chosen token's log-probability and the ``k`` most
    likely alternatives at each step (``0``: the chosen token only), taken from the model's raw
    distribution (before temperature and filters), as vLLM does. A stop string ends the output
    just before it (unless ``include_stop_str_in_output``); stop token ids and EOS end it after
    the token, which stays in ``token_ids`` but not in ``text``. ``detokenize=False`` leaves
    ``text`` empty (token ids only). ``guided_decoding`` holds the output to a JSON schema, a
    regex, a choice or a grammar (serving.engine.guided); EOS is then allowed only where the
    constraint is complete.

    ``n`` completions of the prompt are returned; ``best_of`` (default ``n``) are generated and the
    ``n`` of highest cumulative log-probability returned. Sequence ``i`` of a seeded request draws
    from ``seed_of(seed, i)``. The penalties are vLLM's (serving.engine.penalties): ``presence`` and
    ``frequency`` over the output tokens, ``repetition`` over the prompt's and the output's;
    ``logit_bias`` adds to a token's logit (clamped to ±100, as OpenAI does); ``min_tokens`` bans
    EOS and the stop token ids (and skips stop strings) until that many tokens are out.
    ``prompt_logprobs=k``: each prompt token's log-probability given the tokens before it (the
    first has none) and the ``k`` most likely there, computed in the prefill (vLLM's field; the
    completions endpoint's ``echo`` with ``logprobs`` asks for it).
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    guided_decoding: GuidedDecodingParams | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        if self.best_of is None:
            self.best_of = self.n
        if not isinstance(self.best_of, int) or self.best_of < self.n:
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive number, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.guided_decoding is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with guided decoding: a constrained output ends "
                             "where its grammar does")
        if self.guided_decoding is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with guided decoding: a constrained output ends "
                             "where its grammar does, and banning EOS there would leave no token to sample")
        self.logit_bias = _clamped_bias(self.logit_bias)
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop_strings = tuple(stops)
        if stops and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched in the text)")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @cached_property
    def stop_matcher(self) -> StopStrings | None:
        """The stop strings as one matcher, built once per request where they are matched."""
        return StopStrings(self.stop_strings) if self.stop_strings else None

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def has_penalties(self) -> bool:
        """Whether the presence, frequency or repetition penalty changes anything."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def num_sequences(self) -> int:
        """Sequences generated for the request: ``best_of``."""
        assert self.best_of is not None  # __post_init__ sets it
        return self.best_of


def seed_of(seed: int, index: int) -> int:
    """The seed of sequence ``index`` of a request seeded with ``seed``: ``seed`` itself for the
    first (so ``n=1`` samples as before), a 63-bit hash of both for the others (stable across
    processes and versions, unlike ``hash``)."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _clamped_bias(bias: dict[int, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    clamped = {}
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
        if not isinstance(value, (int, float)) or value != value:
            raise ValueError(f"logit_bias values must be numbers, got {value!r} for token {token}")
        clamped[token] = max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(value)))
    return clamped
