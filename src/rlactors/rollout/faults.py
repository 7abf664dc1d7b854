"""How the rollout router names and classifies an engine replica's faults (the text of an error
is `rlactors.runtime.calls.error_text`'s).

    NoLiveEngineError   no replica is live and none is coming back: names every replica, its
                        state, its number of failures and its last error
    EngineStartError    a replica failed to start, or did not answer within the bound, before
                        training started: names it and carries the engine's own error message
    is_engine_dead(e)   a RayTaskError whose cause is vLLM's EngineDeadError (the actor is alive,
                        its vLLM engine core is not: the replica is killed and restarted)
    LOST_RESULT_ERRORS  a result could not be read (its object was lost, its owner or node died,
                        or fetching it timed out): the replica's requests are re-sent
    engine_stalled(...) a replica that answers health() while its engine core makes no progress
"""

from __future__ import annotations

import ray

MIN_ENGINE_STALL_S = 30.0  # the shortest time without an engine step that counts as a stalled core

LOST_RESULT_ERRORS = (
    ray.exceptions.ObjectLostError,  # with ObjectFetchTimedOutError and OwnerDiedError, its subclasses
    ray.exceptions.GetTimeoutError,
)


class NoLiveEngineError(RuntimeError):
    """No rollout replica is live and none is restarting: the requests left can never be answered."""


class EngineStartError(RuntimeError):
    """A rollout replica failed to start (vLLM's own error inside) or did not start in time."""


def is_engine_dead(error: BaseException) -> bool:
    return isinstance(error, ray.exceptions.RayTaskError) and type(error.cause).__name__ == "EngineDeadError"


def engine_stalled(health: dict, seen: tuple[int, float] | None, now: float, stall_timeout_s: float
                   ) -> tuple[bool, tuple[int, float] | None]:
    """From a replica's `health()` answer while its streams are quiet: whether its engine core made
    no progress (`num_engine_outputs` unchanged) for `stall_timeout_s` with samples in flight and
    nothing pausing them (asleep, a weight update), and what to keep for the next probe: (the
    count, when it was first seen). A vLLM that gives no count is never called stalled, and no
    core is before MIN_ENGINE_STALL_S (one engine step, a long prefill, may take seconds)."""
    count = health.get("num_engine_outputs")
    if count is None or health.get("paused") or not health.get("num_in_flight_samples"):
        return False, None
    if seen is None or seen[0] != count:
        return False, (count, now)
    return now - seen[1] >= max(stall_timeout_s, MIN_ENGINE_STALL_S), seen
