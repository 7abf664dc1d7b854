"""Calls on actors: a bounded wait names what it waited for, a gather sorts every answer by its key,
and an error's text is the exception that failed, not Ray's wrapping."""

import time

import pytest
import ray

from rlactors.runtime.calls import MAX_ERROR_CHARS, MAX_LINE_CHARS, error_text, gather, get_within

TRACEBACK = """ray::RolloutEngine.ready() (pid=123, ip=10.0.0.1, actor_id=ab, repr=<RolloutEngine object>)
  File "/site-packages/ray/_private/async_compat.py", line 50, in wrapper
    return await func(*args, **kwargs)
  File "/site-packages/vllm/config/model.py", line 2646, in get_and_verify_max_len
    raise ValueError(
ValueError: User-specified max_model_len (4096) is greater than the derived max_model_len (1024).
  Set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to override."""


@ray.remote(num_cpus=0)
def answer_after(delay_s: float) -> str:
    time.sleep(delay_s)
    return "done"


@ray.remote(num_cpus=0)
def raise_value_error() -> None:
    raise ValueError("bad bucket")


def test_get_within_answers_or_names_what_it_waited_for(ray_session):
    assert get_within(answer_after.remote(0.0), 60, "quick call") == "done"
    with pytest.raises(TimeoutError, match=r"slow call: no answer within 0.5 s"):
        get_within(answer_after.remote(30.0), 0.5, "slow call")


def test_gather_sorts_values_errors_and_the_not_answered_by_key(ray_session):
    refs = {"quick": answer_after.remote(0.0), "raises": raise_value_error.remote(),
            "slow": answer_after.remote(30.0), "also quick": answer_after.remote(0.0)}
    ray.wait([refs["quick"], refs["raises"], refs["also quick"]], num_returns=3, timeout=60)  # workers started
    start = time.monotonic()
    values, errors, not_answered = gather(refs, timeout_s=1.0)
    assert time.monotonic() - start < 10  # one bound for all, not one per call
    assert values == {"quick": "done", "also quick": "done"}
    assert list(errors) == ["raises"] and error_text(errors["raises"]) == "ValueError: bad bucket"
    assert not_answered == ["slow"]
    assert gather({}, timeout_s=1.0) == ({}, {}, [])


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
    assert error_text(died, first_line=True) == ("the actor's constructor raised ValueError: User-specified "
                                                 "max_model_len (4096) is greater than the derived max_model_len (1024).")


def test_a_death_says_so_and_keeps_ray_s_lines_on_one_line():
    assert error_text(ray.exceptions.RayActorError(error_msg="The actor died.\n\tpid: 7\n")) == "The actor died.; pid: 7"
    died = ray.exceptions.ActorDiedError()
    assert error_text(died, first_line=True).startswith("its process died (ActorDiedError): ")


def test_an_error_outside_ray_keeps_its_type_and_a_long_one_is_shortened():
    assert error_text(OSError("disk full\nmore")) == "OSError: disk full\nmore"
    assert error_text(OSError("disk full\nmore"), first_line=True) == "OSError: disk full"
    text = error_text(task_error(RuntimeError("x" * (3 * MAX_ERROR_CHARS))))
    assert len(text) < MAX_ERROR_CHARS + 100 and text.startswith("RuntimeError: xxx") and text.endswith("xxx")
    line = error_text(RuntimeError("y" * (3 * MAX_LINE_CHARS)), first_line=True)
    assert len(line) < MAX_LINE_CHARS + 100 and line.endswith("yyy")
