"""A running job's pace (training.pace): the ETA and tokens/s count from the end of the first step,
so a slow first step (the warm-up) does not skew them; short jobs log every step."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from training.pace import Pace, log_interval

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def test_no_estimate_until_a_second_step_has_ended():
    pace = Pace()
    assert pace.estimated_finish(36) is None and pace.tokens_per_second() is None
    pace.step_ended(step=1, trained_tokens=100, now=T0)
    assert pace.estimated_finish(36) is None and pace.tokens_per_second() is None


def test_a_slow_first_step_does_not_skew_the_estimate_and_it_holds_at_a_steady_pace():
    # The first step (the warm-up) ends after a minute; every later step takes 2 s and trains 50 tokens.
    pace = Pace()
    pace.step_ended(step=1, trained_tokens=50, now=T0 + timedelta(seconds=60))
    estimates = []
    for step in range(2, 37):
        pace.step_ended(step=step, trained_tokens=50 * step, now=T0 + timedelta(seconds=60 + 2 * (step - 1)))
        estimates.append(pace.estimated_finish(36))
    assert set(estimates) == {T0 + timedelta(seconds=60 + 2 * 35)}
    assert pace.tokens_per_second() == 25.0


def test_a_slow_step_moves_the_estimate_by_its_share_only():
    pace = Pace()
    for step, second in ((1, 0), (2, 1), (3, 2), (4, 3), (5, 13)):  # step 5 took 10 s (a checkpoint)
        pace.step_ended(step=step, trained_tokens=0, now=T0 + timedelta(seconds=second))
    # 4 steps in 13 s: 3.25 s a step for the 5 left.
    assert pace.estimated_finish(10) == T0 + timedelta(seconds=13 + 5 * 3.25)


def test_a_resumed_run_counts_from_its_own_first_step():
    pace = Pace()
    pace.step_ended(step=21, trained_tokens=2100, now=T0)
    pace.step_ended(step=23, trained_tokens=2300, now=T0 + timedelta(seconds=4))
    assert pace.estimated_finish(30) == T0 + timedelta(seconds=4 + 7 * 2)
    assert pace.tokens_per_second() == 50.0


def test_short_jobs_log_every_step_and_long_ones_at_least_a_hundred_points():
    assert log_interval(10, 36) == 1
    assert log_interval(10, 100) == 1
    assert log_interval(10, 450) == 4
    assert log_interval(10, 5000) == 10
    assert log_interval(1, 5000) == 1
    assert log_interval(10, 0) == 1
