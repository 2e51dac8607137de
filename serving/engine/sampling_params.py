"""How to pick each next token and when to stop: vLLM's ``SamplingParams``, the fields this engine
implements, with the same names, defaults and meanings."""

from __future__ import annotations

from dataclasses import dataclass, field

from serving.engine.guided import GuidedDecodingParams

_GREEDY_EPS = 1e-5


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
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    guided_decoding: GuidedDecodingParams | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.n != 1:
            raise ValueError(f"n must be 1 (one completion per request is supported), got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive number, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.guided_decoding is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with guided decoding: a constrained output ends "
                             "where its grammar does")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop_strings = tuple(stops)
        if stops and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched in the text)")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0
