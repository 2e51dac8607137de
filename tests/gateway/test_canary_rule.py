"""The canary-abort rule: breaker opened, or worse than the active version by the margin."""

from __future__ import annotations

from runtime.breakers import Snapshot, State
from serving.gateway.canary_rule import CanaryRuleConfig, canary_abort_reason

RULE = CanaryRuleConfig(failure_rate_margin=0.10, minimum_calls=50)


def snap(name: str, calls: int, failures: int, state: State = State.CLOSED,
         transition: State | None = None) -> Snapshot:
    return Snapshot(name=name, state=state, epoch=1, calls=calls, failures=failures, slow_calls=0,
                    transition=transition)


def test_an_opened_breaker_aborts_with_its_figures() -> None:
    canary = snap("a/bot@1.1.0", 50, 50, State.OPEN, transition=State.OPEN)
    reason = canary_abort_reason(canary=canary, active=None, config=RULE)
    assert reason == "canary a/bot@1.1.0: circuit breaker opened; 50 of 50 calls failed (100%), 0 slow (0%)"


def test_worse_than_the_active_version_by_more_than_the_margin() -> None:
    active = snap("a/bot@1.0.0", 100, 1)
    assert canary_abort_reason(canary=snap("a/bot@1.1.0", 60, 6), active=active, config=RULE) is None  # 10 % vs 1 %
    reason = canary_abort_reason(canary=snap("a/bot@1.1.0", 60, 7), active=active, config=RULE)
    assert reason is not None and "11.7%" in reason and "1.0%" in reason and "7 of 60" in reason


def test_no_verdict_on_small_samples_or_while_half_open() -> None:
    assert canary_abort_reason(canary=snap("c", 49, 20), active=snap("a", 100, 0), config=RULE) is None
    assert canary_abort_reason(canary=snap("c", 60, 20), active=snap("a", 49, 0), config=RULE) is None
    assert canary_abort_reason(canary=snap("c", 60, 20), active=None, config=RULE) is None
    half_open = snap("c", 0, 0, State.HALF_OPEN)
    assert canary_abort_reason(canary=half_open, active=snap("a", 100, 0), config=RULE) is None
