"""The watchdog of one `GenerationStream` (`rlactors.rollout.stream`): it tells a replica that is busy from one
that hangs, among those whose streams have yielded nothing for `stall_timeout_s`.

Such a quiet replica is asked `health()`. One that does not answer within `health_timeout_s` is
hung (its actor is stuck); one that answers that its vLLM engine is dead, or hung (its engine core
left a heartbeat unanswered for `health_timeout_s`: `rlactors.rollout.engine_core.VllmCalls`), is
failed; one that answers
while its engine core made no progress since an earlier probe, with samples in flight and nothing
pausing them, is hung too (its actor answers, its core does not: `faults.engine_stalled`). The
router kills each such replica (Ray restarts it) and re-sends its requests; any other answer means
busy (long responses), and the replica is left alone.
"""

from __future__ import annotations

import time

import ray

from rlactors.rollout.faults import engine_stalled
from rlactors.runtime.calls import outcome


class Watchdog:
    def __init__(self, router):
        self.router = router  # the RolloutRouter whose replicas this call's streams run on
        self.last_progress: dict[int, float] = {}  # replica -> when its streams last yielded (or it answered health)
        self.probes: dict[int, tuple[ray.ObjectRef, float]] = {}  # replica -> (health() call, when sent)
        self.counts: dict[int, tuple[int, float]] = {}  # replica -> (its engine's output count, when first seen)

    def progressed(self, index: int) -> None:
        """Replica `index`'s streams yielded a result."""
        self.last_progress[index] = time.monotonic()

    def check(self, stream) -> list[tuple]:
        """Ask quiet replicas health(); kill one that does not answer in time, is dead, or whose
        engine core made no progress since an earlier probe, and return its requests for re-sending."""
        router, now = self.router, time.monotonic()
        active = {index: incarnation for index, incarnation, _ in stream.streams.values()}
        for index in set(self.last_progress) - set(active):
            self.last_progress.pop(index)
            self.probes.pop(index, None)
            self.counts.pop(index, None)
        lost = []
        for index, incarnation in active.items():
            quiet_s = now - self.last_progress.setdefault(index, now)
            if index not in self.probes:
                if quiet_s >= router.stall_timeout_s:
                    self.probes[index] = (router.engines[index].health.remote(), now)
                    router.count_health_probe()
                continue
            probe, sent_at = self.probes[index]
            if ray.wait([probe], timeout=0)[0]:
                del self.probes[index]
                answer = outcome(probe, router.health_timeout_s)
                stalled = False
                if isinstance(answer, dict) and answer.get("healthy") is not False:
                    stalled, self.counts[index] = engine_stalled(answer, self.counts.get(index), now,
                                                                 router.stall_timeout_s)
                if not (isinstance(answer, dict) and answer.get("healthy") is False) and not stalled:
                    self.last_progress[index] = now  # busy, not hung (a dead actor's streams fail on their own)
                    continue
                reason = (f"its vLLM engine is not healthy while its streams are quiet: {answer.get('error')}" if not stalled else
                          f"hung: its engine core made no progress for {now - self.counts[index][1]:.0f} s with "
                          f"{answer['num_in_flight_samples']} sample(s) in flight, though the actor answers health() "
                          "(rollout.stall_timeout_s)")
                self.counts.pop(index, None)
                router.replicas.mark_failed(index, reason, incarnation, kill=True)
                lost += stream.drop_replica(index)
                self.last_progress.pop(index)
            elif now - sent_at >= router.health_timeout_s:
                reason = (f"hung: no result for {quiet_s:.0f} s and health() unanswered within "
                          f"{router.health_timeout_s:g} s (rollout.stall_timeout_s, rollout.health_timeout_s)")
                router.replicas.mark_failed(index, reason, incarnation, kill=True)
                lost += stream.drop_replica(index)
                self.last_progress.pop(index)
                del self.probes[index]
        return lost
