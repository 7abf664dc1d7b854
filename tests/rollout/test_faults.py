"""What the router reports of an engine's error: the exception that failed, not Ray's wrapping."""

from __future__ import annotations

import ray

from rlactors.rollout.faults import MAX_ERROR_CHARS, error_text, is_engine_dead

TRACEBACK = """ray::RolloutEngine.ready() (pid=123, ip=10.0.0.1, actor_id=ab, repr=<RolloutEngine object>)
  File "/site-packages/ray/_private/async_compat.py", line 50, in wrapper
    return await func(*args, **kwargs)
  File "/site-packages/vllm/config/model.py", line 2646, in get_and_verify_max_len
    raise ValueError(
ValueError: User-specified max_model_len (4096) is greater than the derived max_model_len (1024).
  Set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to override."""


class EngineDeadError(Exception):  # vLLM's is matched by name: the driver need not import vLLM
    pass


def task_error(cause: BaseException) -> ray.exceptions.RayTaskError:
    return ray.exceptions.RayTaskError("ready", TRACEBACK, cause, proctitle="ray::RolloutEngine", pid=1, ip="x")


def test_a_task_error_is_its_cause():
    assert error_text(task_error(RuntimeError("vLLM engine failed to start: no memory"))) == (
        "RuntimeError: vLLM engine failed to start: no memory")


def test_a_constructor_error_keeps_the_exception_and_what_follows_it():
    died = ray.exceptions.ActorDiedError(task_error(ValueError("unused")))
    assert "Traceback" in str(died) or "File " in str(died)  # Ray's message holds the whole traceback
    assert error_text(died) == ("the actor's constructor raised ValueError: User-specified max_model_len (4096) is "
                                "greater than the derived max_model_len (1024).\n"
                                "  Set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to override.")


def test_a_plain_message_is_kept_on_one_line_and_a_long_one_is_shortened():
    assert error_text(ray.exceptions.RayActorError(error_msg="The actor died.\n\tpid: 7\n")) == "The actor died.; pid: 7"
    text = error_text(task_error(RuntimeError("x" * (3 * MAX_ERROR_CHARS))))
    assert len(text) < MAX_ERROR_CHARS + 100 and text.startswith("RuntimeError: xxx") and text.endswith("xxx")


def test_engine_dead_is_recognised_by_the_cause_s_name():
    assert is_engine_dead(task_error(EngineDeadError("engine core died")))
    assert not is_engine_dead(task_error(ValueError("bad bucket")))
    assert not is_engine_dead(EngineDeadError("not wrapped by Ray"))
