"""Outlier ejection as Envoy does it: consecutive failures, growing back-off, at most half ejected."""

from __future__ import annotations

from resilience_support import Clock

from serving.gateway.outliers import OutlierConfig, OutlierDetector


def fail(detector: OutlierDetector, instance: str, times: int, live: int = 4) -> list[bool]:
    return [detector.record(instance, failed=True, live=live) for _ in range(times)]


def test_five_consecutive_failures_eject_and_a_success_resets_the_count() -> None:
    detector = OutlierDetector(clock=Clock())
    assert fail(detector, "w1", 4) == [False] * 4
    detector.record("w1", failed=False, live=4)
    assert fail(detector, "w1", 4) == [False] * 4 and not detector.is_ejected("w1")
    assert fail(detector, "w1", 1) == [True] and detector.is_ejected("w1")


def test_back_off_grows_with_each_ejection_and_is_earned_back() -> None:
    clock = Clock()
    detector = OutlierDetector(OutlierConfig(base_ejection_s=30, max_ejection_s=75), clock=clock)
    fail(detector, "w1", 5)
    clock.advance(29.9)
    assert detector.is_ejected("w1")
    clock.advance(0.1)
    assert not detector.is_ejected("w1")
    fail(detector, "w1", 5)  # second ejection: 60 s
    clock.advance(59)
    assert detector.is_ejected("w1")
    clock.advance(1)
    fail(detector, "w1", 5)  # third: 90 s, capped at 75
    clock.advance(74.9)
    assert detector.is_ejected("w1")
    clock.advance(0.1)
    # Each whole base interval served without ejection earns one ejection back: 3 → 1, so the
    # next ejection is the second again (60 s).
    for _ in range(2):
        clock.advance(30)
        detector.record("w1", failed=False, live=4)
    fail(detector, "w1", 5)
    clock.advance(59.9)
    assert detector.is_ejected("w1")
    clock.advance(0.1)
    assert not detector.is_ejected("w1")


def test_at_most_half_of_the_live_workers_are_ejected() -> None:
    detector = OutlierDetector(clock=Clock())
    assert fail(detector, "w1", 5, live=2)[-1] is True
    assert fail(detector, "w2", 5, live=2)[-1] is False  # it would leave no worker at all
    assert detector.ejected_count() == 1 and not detector.is_ejected("w2")
    single = OutlierDetector(clock=Clock())
    assert fail(single, "only", 10, live=1) == [False] * 10


def test_a_restarted_instance_starts_clean() -> None:
    detector = OutlierDetector(clock=Clock())
    fail(detector, "w1@100.0", 5)
    detector.forget_except(["w1@200.0"])
    assert not detector.is_ejected("w1@100.0") and detector.ejected_count() == 0
