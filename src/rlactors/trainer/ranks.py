"""Waiting on a call that every rank of a trainer group runs at once, and stopping the ranks.

The ranks of a group meet in collectives (FSDP all-gathers and reduce-scatters, metric
all-reduces, barriers), so when one rank raises or dies the others wait in their next collective
for a peer that never comes, until the process group's timeout. `wait_for_ranks` therefore stops
at the FIRST failure instead of waiting for every rank: it kills all ranks of the group (the
survivors are stuck mid-collective and their process group is broken, so they cannot be reused)
and raises one `TrainerRankError` naming the rank, the call and the error.

    values = wait_for_ranks("actor", workers, [w.update_policy.remote(...) for w in workers],
                            "update_policy", timeout_s=trainer.call_timeout_s)

A call not done within `timeout_s` of its start (a rank hung outside any collective) is stopped
the same way, with a TimeoutError naming the call and the ranks not done.

One failure keeps the group: every rank raised the same error (a check before any collective, such
as a call on the wrong role). Then no rank is stuck, and since a collective completes only when all
ranks join it, all ranks have run the same collectives: the process group is intact, and rank 0's
error (a RayTaskError that is also an instance of the error's own type) is raised as it is.
"""

from __future__ import annotations

import time

import ray

from rlactors.runtime.calls import error_text, outcome

# After a first failure, how long the other ranks' outcomes are awaited before the cause is named:
# peers of a SIGKILLed rank may fail in their collective ("connection closed") a moment before
# Ray reports the death itself, and the death is the cause.
CAUSE_GRACE_S = 5.0


class TrainerRankError(RuntimeError):
    """A rank of a trainer group failed in a call; every rank of the group has been killed.

    `rank` is the rank named as the cause (a rank that died, else the first that raised);
    `failures` maps every rank that failed within the grace period to its error."""

    def __init__(self, role: str, call: str, failures: dict[int, BaseException], num_ranks: int,
                 not_done: list[int]):
        self.role, self.call, self.failures, self.not_done = role, call, failures, not_done
        died = [rank for rank, error in failures.items() if not isinstance(error, ray.exceptions.RayTaskError)]
        self.rank = died[0] if died else next(iter(failures))  # dicts keep arrival order
        # One line of each error is enough in the message; the whole error is chained (`raise ... from`).
        message = f"{role} rank {self.rank} failed in {call}: {error_text(failures[self.rank], first_line=True)}"
        others = [f"rank {rank}: {error_text(error, first_line=True)}" for rank, error in failures.items()
                  if rank != self.rank]
        if others:
            message += "; then " + "; ".join(others)
        if not_done:
            message += f"; ranks {not_done} were still in the call"
        super().__init__(message + f" (all {num_ranks} ranks of the {role} group were killed)")


def kill_ranks(workers: list) -> None:
    """Kill every rank actor at once (no restart); an actor already dead is no error."""
    for worker in workers:
        try:
            ray.kill(worker, no_restart=True)
        except Exception:  # noqa: BLE001 - a handle to an actor already gone
            pass


def _all_the_same_raise(errors: list[BaseException]) -> bool:
    """Every error is an exception raised in a rank (no death), all of one type and message."""
    if not all(isinstance(e, ray.exceptions.RayTaskError) for e in errors):
        return False
    return len({(type(e.cause).__name__, str(e.cause)) for e in errors}) == 1


def wait_for_ranks(role: str, workers: list, refs: list[ray.ObjectRef], call: str, timeout_s: float) -> list:
    """The values of `refs` (refs[i] from rank i's `call`), once every one has arrived.

    At the first failure: waits up to CAUSE_GRACE_S for the other ranks' outcomes, kills every
    rank in `workers` and raises TrainerRankError (unless every rank raised the same error, which
    is re-raised, the ranks kept). Past `timeout_s` with ranks not done: kills every rank and
    raises TimeoutError naming them."""
    rank_of = {ref: rank for rank, ref in enumerate(refs)}
    values: list = [None] * len(refs)
    pending = list(refs)
    deadline = time.monotonic() + timeout_s
    while pending:
        remaining_s = deadline - time.monotonic()
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, remaining_s))
        if not ready and remaining_s <= 0:
            kill_ranks(workers)
            raise TimeoutError(f"{role}.{call}: ranks {sorted(rank_of[ref] for ref in pending)} not done within "
                               f"{timeout_s:g} s (trainer.call_timeout_s); all {len(workers)} ranks of the "
                               f"{role} group were killed")
        failures: dict[int, BaseException] = {}
        for ref in ready:
            answer = outcome(ref, CAUSE_GRACE_S)
            if isinstance(answer, ray.exceptions.RayError):
                failures[rank_of[ref]] = answer
            else:
                values[rank_of[ref]] = answer
        if failures:
            if pending:
                more, pending = ray.wait(pending, num_returns=len(pending), timeout=CAUSE_GRACE_S)
                for ref in more:
                    answer = outcome(ref, CAUSE_GRACE_S)
                    if isinstance(answer, ray.exceptions.RayError):
                        failures[rank_of[ref]] = answer
            if len(failures) == len(refs) and _all_the_same_raise(list(failures.values())):
                raise failures[0]
            kill_ranks(workers)
            error = TrainerRankError(role, call, failures, len(workers), sorted(rank_of[ref] for ref in pending))
            raise error from failures[error.rank]
    return values
