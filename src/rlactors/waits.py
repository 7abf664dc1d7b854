"""Bounded waits on actor calls: past the bound, an error naming what was waited for."""

from __future__ import annotations

import ray


def get_within(refs, timeout_s: float, what: str):
    """`ray.get(refs)`, or a TimeoutError naming `what` once `timeout_s` has passed."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"{what}: no answer within {timeout_s:g} s") from None
