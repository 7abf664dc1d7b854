"""How the rollout router names and classifies an engine replica's faults.

    NoLiveEngineError   no replica is live and none is coming back: names every replica, its
                        state, its number of failures and its last error
    EngineStartError    a replica failed to start, or did not answer within the bound, before
                        training started: names it and carries the engine's own error message
    error_text(error)   the useful part of a Ray error: the engine's exception type and message,
                        not Ray's 100-line traceback around it
    is_engine_dead(e)   a RayTaskError whose cause is vLLM's EngineDeadError (the actor is alive,
                        its vLLM engine core is not: the replica is killed and restarted)
    LOST_RESULT_ERRORS  a result could not be read (its object was lost, its owner or node died,
                        or fetching it timed out): the replica's requests are re-sent
    outcome(ref, t)     a finished call's value, or its error as a value
"""

from __future__ import annotations

import re

import ray

MAX_ERROR_CHARS = 4000  # an error text longer than this keeps its head and tail

LOST_RESULT_ERRORS = (
    ray.exceptions.ObjectLostError,  # with ObjectFetchTimedOutError and OwnerDiedError, its subclasses
    ray.exceptions.GetTimeoutError,
)

# The line a Python traceback ends with: "ValueError: ..." or "vllm.engine.SomeError: ...", at
# column 0 with no space before the colon (frame lines are indented; Ray's "ray::Actor.method()"
# header has "::").
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*: ")
# Lines of Ray's actor-death message that only identify the actor (the replica is named anyway).
_ID_LINE = re.compile(r"^(class_name|actor_id|namespace): ")


class NoLiveEngineError(RuntimeError):
    """No rollout replica is live and none is restarting: the requests left can never be answered."""


class EngineStartError(RuntimeError):
    """A rollout replica failed to start (vLLM's own error inside) or did not start in time."""


def is_engine_dead(error: BaseException) -> bool:
    return isinstance(error, ray.exceptions.RayTaskError) and type(error.cause).__name__ == "EngineDeadError"


def error_text(error: BaseException) -> str:
    """`Type: message` of the exception that actually failed, from inside Ray's wrapping when there
    is one; a bare actor death keeps Ray's own lines (they say which process died and why)."""
    if isinstance(error, ray.exceptions.RayTaskError):
        cause = error.cause
        if isinstance(cause, BaseException) and not isinstance(cause, ray.exceptions.RayError):
            return _shorten(f"{type(cause).__name__}: {cause}")
        return _shorten(_last_exception(str(cause if cause is not None else error)))
    text = _last_exception(str(error)) if str(error) else type(error).__name__
    if isinstance(error, ray.exceptions.RayActorError) and error.actor_init_failed:
        text = f"the actor's constructor raised {text}"
    return _shorten(text)


def _last_exception(text: str) -> str:
    """From the last exception line of a traceback in `text` to the end; else the text on one line."""
    lines = text.splitlines()
    for start in range(len(lines) - 1, -1, -1):
        if _EXCEPTION_LINE.match(lines[start]):
            return "\n".join(lines[start:]).strip()
    return "; ".join(line.strip() for line in lines if line.strip() and not _ID_LINE.match(line.strip()))


def _shorten(text: str) -> str:
    if len(text) <= MAX_ERROR_CHARS:
        return text
    half = MAX_ERROR_CHARS // 2
    return f"{text[:half]} [... {len(text) - 2 * half} characters ...] {text[-half:]}"


def outcome(ref: ray.ObjectRef, timeout_s: float):
    """The value of a finished call, or the Ray error it raised (returned, not raised)."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.RayError as error:
        return error
