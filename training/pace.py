"""A running job's pace: when it will finish and how many tokens a second it trains.

Both are measured from the end of the run's first step, not its start: the first step carries the
warm-up (loading kernels, allocating the optimizer's state, filling caches) and on a CPU can take
several steps' time, so counting it made the first estimates far too late and then drift. Until a
second step has ended there is no estimate (None) rather than a guess. The rate is the mean over
every step since, so a slow step (an evaluation, a checkpoint) moves the estimate by its share only.
No Django here; the caller passes the clock in.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

# Jobs up to this many chart points' worth of steps log every step; longer ones log at most every
# TRAINING_LOG_EVERY_STEPS, but never fewer than this many points in all (a 36-step job showed 4).
MIN_CHART_POINTS = 100


def log_interval(configured: int, total_steps: int) -> int:
    """Steps between two logged points: the configured interval, shortened so that a job of
    `total_steps` logs at least MIN_CHART_POINTS points (every step when it has no more)."""
    return max(1, min(configured, total_steps // MIN_CHART_POINTS))


@dataclass
class Pace:
    """The pace of one run, fed each ended step (`step_ended`)."""

    first_step: int | None = None
    first_tokens: int = 0
    started: datetime | None = None
    last_step: int = 0
    last_tokens: int = 0
    last_time: datetime | None = None

    def step_ended(self, *, step: int, trained_tokens: int, now: datetime) -> None:
        if self.first_step is None:
            self.first_step, self.first_tokens, self.started = step, trained_tokens, now
        self.last_step, self.last_tokens, self.last_time = step, trained_tokens, now

    def _elapsed(self) -> float | None:
        if self.started is None or self.last_time is None or self.first_step is None or self.last_step <= self.first_step:
            return None
        return (self.last_time - self.started).total_seconds()

    def estimated_finish(self, total_steps: int) -> datetime | None:
        """When the last of `total_steps` ends at the pace so far; None before two steps have ended."""
        elapsed = self._elapsed()
        if elapsed is None or self.last_time is None or self.first_step is None:
            return None
        per_step = elapsed / (self.last_step - self.first_step)
        return self.last_time + timedelta(seconds=per_step * max(0, total_steps - self.last_step))

    def tokens_per_second(self) -> float | None:
        """Trained tokens a second since the first step ended; None before two steps have ended."""
        elapsed = self._elapsed()
        if not elapsed:
            return None
        return (self.last_tokens - self.first_tokens) / elapsed
