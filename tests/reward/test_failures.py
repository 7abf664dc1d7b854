"""The rule that stops a run whose scoring fails on every sample (pure, no Ray)."""

from __future__ import annotations

import pytest

from rlactors.reward.failures import FailureStreak, ScoringFailedError


def test_stops_on_the_nth_failed_step_in_a_row_with_the_streaks_first_error():
    streak = FailureStreak(3)
    streak.record(8, 8, "prompt_id=a sample_index=0: ZeroDivisionError")
    streak.record(8, 8, "prompt_id=b sample_index=0: later")  # the streak keeps its first step's error
    with pytest.raises(ScoringFailedError, match=r"3 steps in a row \(reward.max_failed_steps=3\); "
                                                 r"first error: prompt_id=a sample_index=0: ZeroDivisionError"):
        streak.record(8, 8, "prompt_id=c sample_index=0: later still")


def test_a_step_with_any_scored_sample_resets_the_streak():
    streak = FailureStreak(2)
    streak.record(8, 8, "first")
    streak.record(8, 7, "unused")
    assert streak.num_failed_steps == 0 and streak.first_error is None
    streak.record(8, 8, "second")
    with pytest.raises(ScoringFailedError, match="first error: second"):
        streak.record(8, 8, "unused")


def test_zero_never_stops_and_empty_steps_do_not_count():
    never = FailureStreak(0)
    for _ in range(100):
        never.record(4, 4, "x")
    assert never.num_failed_steps == 100
    streak = FailureStreak(1)
    streak.record(0, 0, "x")
    assert streak.num_failed_steps == 0


@pytest.mark.parametrize("num_samples,num_errors", [(4, 5), (4, -1)])
def test_impossible_counts_are_an_error(num_samples, num_errors):
    with pytest.raises(ValueError, match="score errors"):
        FailureStreak(3).record(num_samples, num_errors, None)
    with pytest.raises(ValueError, match="max_failed_steps"):
        FailureStreak(-1)
