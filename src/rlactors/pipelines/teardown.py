"""Stopping every actor of a run, whatever fails or hangs on the way.

    stop_all(run_parts(trainers, router, reward, buffer, builder), placement)

Each part is stopped in turn, each within PART_TIMEOUT_S: a part whose stop raises or hangs is
then killed by force (`ray.kill` of its actors), its error is collected, and the next part is
stopped all the same. The placement groups are released last, always. The errors are reported once
everything is down: raised as one RuntimeError, or, when the teardown runs because of another error
(in a `finally` or `except` block), added as a note to that error, which stays the one raised.

Placement groups take the actors in their bundles with them (trainer ranks, engines), but not the
actors outside the bundles (the replay buffer and the batch builder sit on a node by affinity, the
reward scorers anywhere), nor the processes an actor started: every part is stopped explicitly.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import ray

from rlactors.runtime.calls import error_text

# A graceful stop (trainer ranks leaving their process group, reward workers ending their
# subprocesses) takes seconds; longer means the part is stuck, and it is killed.
PART_TIMEOUT_S = 30.0


@dataclass
class Part:
    """One thing to stop: `stop()` the graceful way, `actors` killed in any case afterwards."""

    name: str
    stop: Callable[[], None] | None = None
    actors: list = field(default_factory=list)


def run_parts(trainers, router, reward, buffer, builder) -> list[Part]:
    """The parts of a run in stopping order; any of them may be None (not started yet)."""
    parts = [Part(f"{group.role} trainer group", group.shutdown, list(group.workers))
             for group in trainers if group is not None]
    if router is not None:
        parts += [Part(f"rollout engine {i}", actors=[engine]) for i, engine in enumerate(router.engines)]
    if reward is not None:
        parts.append(Part("reward scorers", reward.shutdown, list(reward.actors)))
    parts += [Part(name, actors=[actor]) for name, actor in
              (("replay buffer", buffer.actor if buffer is not None else None), ("batch builder", builder))
              if actor is not None]
    return parts


def _within(stop: Callable[[], None], timeout_s: float) -> BaseException | None:
    """Run `stop` in a daemon thread for at most `timeout_s`; its error, or a TimeoutError if it
    did not return (the thread is left behind, blocked on actors about to be killed)."""
    outcome: list[BaseException | None] = []

    def target():
        try:
            stop()
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - reported by the caller
            outcome.append(error)

    thread = threading.Thread(target=target, daemon=True, name="rlactors-teardown")
    thread.start()
    thread.join(timeout_s)
    return outcome[0] if outcome else TimeoutError(f"did not stop within {timeout_s:g} s")


def stop_all(parts: list[Part], placement=None, timeout_s: float = PART_TIMEOUT_S) -> None:
    """Stop every part and release `placement` (a `rlactors.placement.cluster.Placement`), then
    report what failed (see the module docstring)."""
    errors = []
    try:
        for part in parts:
            error = _within(part.stop, timeout_s) if part.stop is not None else None
            if error is not None:
                errors.append(f"{part.name}: {error_text(error, first_line=True)}")
            for actor in part.actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception as kill_error:  # noqa: BLE001 - collected; the other actors still go
                    errors.append(f"{part.name}: kill failed: {error_text(kill_error, first_line=True)}")
    finally:
        if placement is not None:
            placement.release()
    if not errors:
        return
    message = "run shutdown: everything was stopped, but " + "; ".join(errors)
    active = sys.exc_info()[1]
    if active is not None:
        active.add_note(message)
        print(message, file=sys.stderr)
        return
    raise RuntimeError(message)
