"""Calls on Ray actors, seen from their caller: every wait bounded, every error turned into text one
way. The packages above wait on actors only through these.

    get_within(refs, timeout_s, what)   ray.get, or a TimeoutError naming `what` past the bound
    gather(refs_by_key, timeout_s)      wait for all within one bound, then sort the answers into
                                        values, errors and not answered, by the caller's keys
    outcome(ref, timeout_s)             a finished call's value, or the Ray error it raised, as a value
    error_text(error, max_chars)        `Type: message` of the exception that actually failed, from
                                        inside Ray's wrapping; a bare actor death keeps Ray's lines
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping
from typing import NamedTuple

import ray

MAX_ERROR_CHARS = 4000  # an error text longer than this keeps its head and tail
MAX_LINE_CHARS = 300  # the same, for a one-line text (its whole error chained beside it)

# The line a Python traceback ends with: "ValueError: ..." or "vllm.engine.SomeError: ...", at
# column 0 with no space before the colon (frame lines are indented; Ray's "ray::Actor.method()"
# header has "::").
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*: ")
# Lines of Ray's actor-death message that only identify the actor (the caller names it anyway).
_ID_LINE = re.compile(r"^(class_name|actor_id|namespace): ")


def get_within(refs, timeout_s: float, what: str):
    """`ray.get(refs)`, or a TimeoutError naming `what` once `timeout_s` has passed."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"{what}: no answer within {timeout_s:g} s") from None


class Gathered(NamedTuple):
    values: dict  # key -> the call's value
    errors: dict  # key -> the Ray error it raised (RayTaskError, an actor's death, a lost result)
    not_answered: list  # keys whose call had not finished within the bound, in the caller's order


def gather(refs_by_key: Mapping[Hashable, ray.ObjectRef], timeout_s: float) -> Gathered:
    """Wait once, at most `timeout_s`, for every call in `refs_by_key`, then sort them by key. A
    result that finished but cannot be read within `timeout_s` (its node died) is an error."""
    if not refs_by_key:
        return Gathered({}, {}, [])
    refs = list(refs_by_key.values())
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=False)
    ready = set(ready)
    gathered = Gathered({}, {}, [])
    for key, ref in refs_by_key.items():
        if ref not in ready:
            gathered.not_answered.append(key)
            continue
        answer = outcome(ref, timeout_s)
        (gathered.errors if isinstance(answer, ray.exceptions.RayError) else gathered.values)[key] = answer
    return gathered


def outcome(ref: ray.ObjectRef, timeout_s: float):
    """The value of a finished call, or the Ray error it raised (returned, not raised)."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.RayError as error:
        return error


def error_text(error: BaseException, max_chars: int | None = None, first_line: bool = False) -> str:
    """`Type: message` of the exception that actually failed, unwrapped from Ray's RayTaskError; an
    actor's death keeps Ray's own lines (they say which process died and why). `first_line` keeps
    the first line only, for a one-line message whose error is chained beside it. Past `max_chars`
    (MAX_LINE_CHARS for a first line, else MAX_ERROR_CHARS) the text keeps its head and tail."""
    text = _describe(error)
    if first_line:
        text = text.split("\n", 1)[0]
    max_chars = max_chars or (MAX_LINE_CHARS if first_line else MAX_ERROR_CHARS)
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]} [... {len(text) - 2 * half} characters ...] {text[-half:]}"


def _describe(error: BaseException) -> str:
    if isinstance(error, ray.exceptions.RayTaskError):
        cause = error.cause
        if isinstance(cause, BaseException) and not isinstance(cause, ray.exceptions.RayError):
            return f"{type(cause).__name__}: {cause}"
        return _last_exception(str(cause if cause is not None else error))
    if not isinstance(error, ray.exceptions.RayError):
        return f"{type(error).__name__}: {error}"
    text = _last_exception(str(error)) if str(error) else type(error).__name__
    if isinstance(error, ray.exceptions.RayActorError) and error.actor_init_failed:
        return f"the actor's constructor raised {text}"
    if isinstance(error, ray.exceptions.ActorDiedError):
        return f"its process died (ActorDiedError): {text}"
    return text


def _last_exception(text: str) -> str:
    """From the last exception line of a traceback in `text` to the end; else the text on one line."""
    lines = text.splitlines()
    for start in range(len(lines) - 1, -1, -1):
        if _EXCEPTION_LINE.match(lines[start]):
            return "\n".join(lines[start:]).strip()
    return "; ".join(line.strip() for line in lines if line.strip() and not _ID_LINE.match(line.strip()))
