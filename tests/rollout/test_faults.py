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
