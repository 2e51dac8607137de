"""Learning-rate schedules: linear warm-up, then linear or cosine decay to zero (or a constant rate).

The factor multiplies the job's learning rate (torch's LambdaLR). Step `s` is the optimizer step
about to be taken, 0-based; the warm-up takes `int(total × warmup_ratio)` steps, rising from
1/(warmup + 1) to 1, so the first step never has a zero rate. After it, with
`progress = (s − warmup) / (total − warmup)`:

- linear: `1 − progress`
- cosine: `½ (1 + cos(π · progress))`
- constant: `1`

The schedule is a pure function of the step, so the scheduler state a checkpoint holds (its step)
is all a resumed run needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    return int(total_steps * warmup_ratio)


def lr_factor(schedule: str, step: int, total_steps: int, warmup_ratio: float) -> float:
    """The factor of the learning rate at optimizer step `step` (0-based) of `total_steps`."""
    warmup = warmup_steps(total_steps, warmup_ratio)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    raise ValueError(f"unknown learning-rate schedule {schedule!r}")


def lr_lambda(schedule: str, total_steps: int, warmup_ratio: float) -> Callable[[int], float]:
    """lr_factor for LambdaLR; an unknown schedule fails here, before any step."""
    lr_factor(schedule, 0, total_steps, warmup_ratio)
    return lambda step: lr_factor(schedule, step, total_steps, warmup_ratio)
