"""A bounded wait names what it waited for."""

import time

import pytest
import ray

from rlactors.waits import get_within


@ray.remote(num_cpus=0)
def answer_after(delay_s: float) -> str:
    time.sleep(delay_s)
    return "done"


def test_get_within_answers_or_names_what_it_waited_for(ray_session):
    assert get_within(answer_after.remote(0.0), 60, "quick call") == "done"
    with pytest.raises(TimeoutError, match=r"slow call: no answer within 0.5 s"):
        get_within(answer_after.remote(30.0), 0.5, "slow call")
