"""The step-time model behind the adaptive token budget (``EngineConfig.decode_stall_target``).

A step that carries decodes and a prompt chunk makes every running sequence wait for the chunk:
its time per output token is the whole step's time. Sarathi-Serve (Agrawal et al., OSDI '24)
bounds that stall by bounding the step's tokens; the right bound depends on the model, the device
and the decode batch, so it is computed each step from what steps have been measured to cost.

``StepCostModel`` is fed each step's (tokens, wall seconds) by the engine after the step ran
(``observe``) and fits ``seconds ≈ fixed + per_token · tokens`` by least squares (``fit``). The
samples are kept per half-octave of token counts (the last ``samples_per_bin`` of each), and the fit
weighs each bin alike, so thousands of steps of one size (a steady decode batch, the budget
itself) neither drown the other sizes nor make the fit degenerate, and a size no longer run keeps
its last measures. A bin's point is the mean of its samples once those slower than twice its median
are dropped: a stall (an allocator's growth, a collection, a first replay) makes a step slower,
never faster. Until ``min_bins`` bins hold samples, or where the fit says a token costs nothing or
a step costs nothing by itself, there is no fit and the scheduler keeps the full budget.

``stall_budget`` turns a fit into the step's token budget. Nothing here reads a clock: tests feed
synthetic times.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

# A step that carries decodes still gives prompts at least this many tokens, so a prefill progresses
# where the fit says any chunk would break the target (a target near 1, a host-bound step).
MIN_PREFILL_CHUNK = 64


@dataclass(frozen=True)
class StepCostFit:
    """``seconds(tokens) = fixed + per_token · tokens``: a step's wall time by its token count."""

    fixed: float
    per_token: float

    def seconds(self, tokens: int) -> float:
        return self.fixed + self.per_token * tokens


class StepCostModel:
    """Least squares of step time on step tokens over recent steps, per half-octave of tokens."""

    def __init__(self, *, samples_per_bin: int = 16, min_bins: int = 3) -> None:
        if samples_per_bin < 1 or min_bins < 2:
            raise ValueError(f"samples_per_bin must be >= 1 and min_bins >= 2, got {samples_per_bin}, {min_bins}")
        self.samples_per_bin = samples_per_bin
        self.min_bins = min_bins
        self._bins: dict[int, deque[tuple[int, float]]] = {}
        self._fit: StepCostFit | None = None
        self._stale = False  # a sample came since _fit was computed

    def observe(self, tokens: int, seconds: float) -> None:
        """A step of ``tokens`` tokens took ``seconds`` (steps of no tokens, or of no time, teach nothing)."""
        if tokens < 1 or not seconds > 0 or not math.isfinite(seconds):
            return
        bin_index = int(2 * math.log2(tokens))
        self._bins.setdefault(bin_index, deque(maxlen=self.samples_per_bin)).append((tokens, seconds))
        self._stale = True

    def fit(self) -> StepCostFit | None:
        """The line through the bins' points, or None while it is no usable model (above)."""
        if self._stale:
            self._fit = self._compute()
            self._stale = False
        return self._fit

    def _compute(self) -> StepCostFit | None:
        if len(self._bins) < self.min_bins:
            return None
        points = [_bin_point(samples) for samples in self._bins.values()]
        mean_x = sum(x for x, _ in points) / len(points)
        mean_y = sum(y for _, y in points) / len(points)
        spread = sum((x - mean_x) ** 2 for x, _ in points)
        if spread <= 0:
            return None
        per_token = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
        fixed = mean_y - per_token * mean_x
        if per_token <= 0 or fixed <= 0:
            return None
        return StepCostFit(fixed=fixed, per_token=per_token)


def _bin_point(samples: deque[tuple[int, float]]) -> tuple[float, float]:
    """A bin's (mean tokens, mean seconds), its samples slower than twice its (lower) median left out."""
    times = sorted(seconds for _, seconds in samples)
    bound = 2 * times[(len(times) - 1) // 2]
    kept = [(tokens, seconds) for tokens, seconds in samples if seconds <= bound]
    return sum(t for t, _ in kept) / len(kept), sum(s for _, s in kept) / len(kept)


def stall_budget(fit: StepCostFit, decode_tokens: int, target: float, ceiling: int) -> int:
    """The most tokens a step carrying ``decode_tokens`` decodes may hold so that it takes at most
    ``target`` times the decode-only step's predicted time: ``(target · t(decodes) − fixed) /
    per_token``, at least the decodes and ``MIN_PREFILL_CHUNK`` more, at most ``ceiling``."""
    allowed = target * fit.seconds(decode_tokens)
    # A millionth of a token's slack: a fit's rounding must not cost a whole token at an exact bound.
    tokens = math.floor((allowed - fit.fixed) / fit.per_token + 1e-6)
    return min(ceiling, max(tokens, decode_tokens + MIN_PREFILL_CHUNK))
