"""When a canary must be taken out of traffic: the rule, without Django (serving.registry.canary_guard acts on it).

A canary is aborted when its own breaker opens (it failed or was slow past the breaker's
thresholds), or when, over at least `minimum_calls` of its own calls and of the active version's,
its failure rate exceeds the active version's by more than `failure_rate_margin`: a canary at 12 %
failures beside an active version at 1 % is worse even though it stays under the breaker's 30 %.
The reason carries the figures, for the audit log.
"""

from __future__ import annotations

from runtime.breakers import Snapshot, State
from runtime.env import EnvModel, env

class CanaryRuleConfig(EnvModel):
    """When a canary is aborted: its breaker opened, or its failure rate is over the active
    version's by more than `failure_rate_margin`, both over at least `minimum_calls` calls."""

    failure_rate_margin: float = env(0.10, "GATEWAY_CANARY_ABORT_MARGIN")
    minimum_calls: int = env(50, "GATEWAY_CANARY_ABORT_MIN_CALLS")


def _figures(snapshot: Snapshot) -> str:
    return (f"{snapshot.failures} of {snapshot.calls} calls failed ({snapshot.failure_rate:.0%}), "
            f"{snapshot.slow_calls} slow ({snapshot.slow_call_rate:.0%})")


def canary_abort_reason(*, canary: Snapshot, active: Snapshot | None, config: CanaryRuleConfig) -> str | None:
    """Why the canary must be aborted, or None while it may keep running.

    `canary` is the snapshot its last call left (its `transition` says whether that call opened
    the breaker, and then its figures are the window that did); `active` the active version's.
    """
    if canary.transition is State.OPEN or canary.state is State.OPEN:
        return f"canary {canary.name}: circuit breaker opened; {_figures(canary)}"
    if active is None or canary.state is not State.CLOSED:
        return None
    if canary.calls < config.minimum_calls or active.calls < config.minimum_calls:
        return None
    if canary.failure_rate - active.failure_rate > config.failure_rate_margin:
        return (f"canary {canary.name}: failure rate {canary.failure_rate:.1%} exceeds the active version "
                f"{active.name}'s {active.failure_rate:.1%} by more than {config.failure_rate_margin:.0%}; "
                f"canary {_figures(canary)}; active {_figures(active)}")
    return None
