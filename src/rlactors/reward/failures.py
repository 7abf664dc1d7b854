"""Stopping a run whose scoring fails everywhere, instead of training on zero rewards.

    streak = FailureStreak(max_failed_steps=3)
    streak.record(num_samples=16, num_errors=16, first_error="prompt_id=p0 ...: ZeroDivisionError")
    # raises ScoringFailedError on the third step in a row where every sample failed

A step counts as failed when every one of its samples carries a score error (its function raised,
timed out, returned a wrong value, or the rollout failed). One step with any scored sample resets
the count. `max_failed_steps=0` never stops.
"""

from __future__ import annotations


class ScoringFailedError(RuntimeError):
    """Scoring failed on every sample for `max_failed_steps` steps in a row."""


class FailureStreak:
    """Counts consecutive steps whose samples all failed scoring. Pure: no Ray, no I/O."""

    def __init__(self, max_failed_steps: int) -> None:
        if max_failed_steps < 0:
            raise ValueError(f"max_failed_steps must be >= 0, got {max_failed_steps}")
        self.max_failed_steps = max_failed_steps
        self.num_failed_steps = 0
        self.first_error: str | None = None  # of the current streak

    def record(self, num_samples: int, num_errors: int, first_error: str | None) -> None:
        """Count one step. `first_error` is the text of the step's first score error; the streak
        keeps its first step's. Raises ScoringFailedError naming that error when the streak reaches
        `max_failed_steps`."""
        if num_errors > num_samples or num_errors < 0:
            raise ValueError(f"a step has {num_errors} score errors for {num_samples} samples")
        if num_samples == 0 or num_errors < num_samples:
            self.num_failed_steps, self.first_error = 0, None
            return
        self.num_failed_steps += 1
        if self.num_failed_steps == 1:
            self.first_error = first_error
        if self.max_failed_steps and self.num_failed_steps >= self.max_failed_steps:
            raise ScoringFailedError(
                f"scoring failed on every sample for {self.num_failed_steps} steps in a row "
                f"(reward.max_failed_steps={self.max_failed_steps}); first error: {self.first_error}"
            )
