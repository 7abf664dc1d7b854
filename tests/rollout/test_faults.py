"""How the router classifies an engine's error (its text: tests/runtime/test_calls.py)."""

from __future__ import annotations

import ray

from rlactors.rollout.faults import is_engine_dead


class EngineDeadError(Exception):  # vLLM's is matched by name: the driver need not import vLLM
    pass


def task_error(cause: BaseException) -> ray.exceptions.RayTaskError:
    return ray.exceptions.RayTaskError("generate", "traceback", cause, proctitle="ray::RolloutEngine", pid=1, ip="x")


def test_engine_dead_is_recognised_by_the_cause_s_name():
    assert is_engine_dead(task_error(EngineDeadError("engine core died")))
    assert not is_engine_dead(task_error(ValueError("bad bucket")))
    assert not is_engine_dead(EngineDeadError("not wrapped by Ray"))


def test_an_engine_core_is_stalled_once_its_output_count_stands_still_for_the_bound():
    from rlactors.rollout.faults import MIN_ENGINE_STALL_S, engine_stalled

    busy = {"num_engine_outputs": 40, "num_in_flight_samples": 8, "paused": False}
    stalled, seen = engine_stalled(busy, None, 100.0, 60.0)  # the first look: remembered
    assert not stalled and seen == (40, 100.0)
    assert engine_stalled(busy, seen, 130.0, 60.0) == (False, seen)  # not yet the bound
    assert engine_stalled(busy, seen, 160.0, 60.0) == (True, seen)  # no step for 60 s with samples in flight
    assert engine_stalled(busy | {"num_engine_outputs": 41}, seen, 160.0, 60.0) == (False, (41, 160.0))  # it moved
    for excused in ({"paused": True}, {"num_in_flight_samples": 0}, {"num_engine_outputs": None}):
        assert engine_stalled(busy | excused, seen, 1000.0, 60.0) == (False, None)  # asleep, idle, or no count
    # A bound below the floor: one slow step (a long prefill) is not a stall.
    assert engine_stalled(busy, seen, 100.0 + MIN_ENGINE_STALL_S - 1, 0.0) == (False, seen)
    assert engine_stalled(busy, seen, 100.0 + MIN_ENGINE_STALL_S, 0.0) == (True, seen)
