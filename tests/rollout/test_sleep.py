"""Which of vLLM's sleeping allocations a wake-up wakes, and the wake-ups refused."""

from __future__ import annotations

import pytest

from rlactors.rollout.sleep import SLEEP_TAGS, tags_to_wake


def test_a_wake_up_wakes_the_named_sleeping_tags_in_wake_order():
    assert tags_to_wake(list(SLEEP_TAGS), None, weights_discarded=False) == ["weights", "kv_cache"]
    assert tags_to_wake(list(SLEEP_TAGS), ["kv_cache", "weights"], weights_discarded=False) == ["weights", "kv_cache"]
    assert tags_to_wake(["kv_cache"], None, weights_discarded=True) == ["kv_cache"]  # weights loaded meanwhile
    assert tags_to_wake(["kv_cache"], ["weights"], weights_discarded=False) == []  # awake already: nothing to do
    assert tags_to_wake([], None, weights_discarded=False) == []


def test_a_wake_up_refuses_unknown_tags_and_weights_a_level_2_sleep_discarded():
    with pytest.raises(ValueError, match="allowed values"):
        tags_to_wake(list(SLEEP_TAGS), ["weights", "activations"], weights_discarded=False)
    with pytest.raises(RuntimeError, match="level-2 sleep discarded the weights"):
        tags_to_wake(list(SLEEP_TAGS), None, weights_discarded=True)
