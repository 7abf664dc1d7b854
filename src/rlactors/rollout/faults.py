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
"""

from __future__ import annotations

import ray

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
