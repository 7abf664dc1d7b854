"""GenerationStream: requests in flight across a `RolloutRouter`'s replicas, added to at any time,
their Groups taken in completion order. The router's `generate_refs` is one stream, filled once
and drained; the fully-async producer keeps one open for a whole run and tops it up group by group
as groups finish (`rlactors.pipelines.fully_async`), so no engine waits for a batch's longest response.

    stream = router.stream()
    stream.add(requests, sampling)                  # sent at once, each to the least-loaded replica
    for summary, group_ref in stream.next_done(timeout_s=0.5):   # what finished meanwhile ([] if none)
        ...                                         # the Group stays in the object store
    stream.num_in_flight                            # requests not yet answered
    stream.close()                                  # abort what is left (the run is over)

Where a request goes: to the live replica with the fewest tokens in flight, counted as the
tokens the stream's unanswered requests on it may hold (each sample's prompt plus its response
cap: the KV cache it can claim). Equal requests over idle replicas alternate as a round robin
would; a replica whose long responses are still running gets fewer new ones.

Guarantees (the router's, see `rlactors.rollout.router`): every request added yields exactly one
Group, or a call raises; a replica that dies, loses a result or hangs (`rlactors.rollout.watchdog`)
is failed and its unanswered requests are sent again, from scratch, to live replicas; a group whose
tokens carry a version older than the one its replica held (Ray restarted it unseen) is not
yielded, and is sent again. One thread uses a stream; replica states are the router's, locked.
"""

from __future__ import annotations

import time

import ray

from rlactors.config import SamplingConfig
from rlactors.rollout.faults import LOST_RESULT_ERRORS, NoLiveEngineError, is_engine_dead
from rlactors.rollout.samples import GroupSummary, SamplingArg, resolve_sampling, sampling_per_request
from rlactors.rollout.watchdog import Watchdog
from rlactors.runtime.calls import error_text
from rlactors.types import PromptRequest

POLL_INTERVAL_S = 1.0  # the longest a wait goes between looks at revivals and the watchdog


def request_tokens(request: PromptRequest, sampling: SamplingArg, default: SamplingConfig) -> int:
    """The tokens a request may hold in its engine: each sample's prompt and response cap."""
    setting = resolve_sampling(sampling, default)
    return setting.num_samples_per_prompt * (len(request.prompt_token_ids) + setting.max_response_tokens)


def least_loaded(loads: dict[int, int], costs: list[int]) -> list[int]:
    """The replica for each of `costs`, in order: the one with the fewest tokens in flight
    (`loads`, replica -> tokens), counting those already given out; ties go to the lower index."""
    loads, chosen = dict(loads), []
    for cost in costs:
        index = min(loads, key=lambda i: (loads[i], i))
        loads[index] += cost
        chosen.append(index)
    return chosen


class GenerationStream:
    def __init__(self, router):
        self.router = router
        self.outstanding: list[tuple[PromptRequest, SamplingArg]] = []  # not sent: no live replica yet
        self.pending: dict = {}  # ObjectRefGenerator -> {group_id: (request, sampling)} not yet returned
        self.streams: dict = {}  # ObjectRefGenerator -> (replica, incarnation it was sent to, version it held)
        # An engine streams each Group, then its summary: the summary confirms the Group before it
        # (an engine that dies in between ends its stream with an error in the summary's place).
        self.unconfirmed: dict = {}  # ObjectRefGenerator -> ref of the Group whose summary comes next
        self.watchdog = Watchdog(router)

    @property
    def num_in_flight(self) -> int:
        return len(self.outstanding) + sum(len(requests) for requests in self.pending.values())

    def group_ids(self) -> set[str]:
        return {r.group_id for r, _ in self.outstanding} | {g for requests in self.pending.values() for g in requests}

    def add(self, requests: list[PromptRequest], sampling: SamplingArg | list[SamplingArg] = None) -> None:
        """Send `requests` (one sampling argument for all, or one each); a group_id already in
        flight on this stream, or twice among them, is refused."""
        settings = sampling_per_request(sampling, len(requests))
        group_ids = [r.group_id for r in requests]
        in_flight = self.group_ids()
        duplicates = sorted({g for g in group_ids if group_ids.count(g) > 1 or g in in_flight})
        if duplicates:
            raise ValueError(f"duplicate group_ids in flight: {duplicates[:5]}")
        self.outstanding += zip(requests, settings, strict=True)
        self._send()

    def tokens_in_flight(self) -> dict[int, int]:
        """Replica -> the tokens its unanswered requests on this stream may hold."""
        loads: dict[int, int] = {}
        default = self.router.default_sampling
        for stream, requests in self.pending.items():
            index = self.streams[stream][0]
            loads[index] = loads.get(index, 0) + sum(request_tokens(r, s, default) for r, s in requests.values())
        return loads

    def _send(self) -> None:
        """Send what is outstanding to the least-loaded live replicas, one generate call per replica."""
        live = dict(self.router.replicas.live())
        if not self.outstanding or not live:
            return
        in_flight = self.tokens_in_flight()
        default = self.router.default_sampling
        chosen = least_loaded({index: in_flight.get(index, 0) for index in live},
                              [request_tokens(r, s, default) for r, s in self.outstanding])
        for index in sorted(set(chosen)):
            share = [pair for pair, replica in zip(self.outstanding, chosen, strict=True) if replica == index]
            stream = self.router.engines[index].generate.remote([r for r, _ in share], [s for _, s in share],
                                                                with_summaries=True)
            self.streams[stream] = (index, live[index], self.router.replicas.loaded_version(index))
            self.pending[stream] = {r.group_id: (r, s) for r, s in share}
        self.outstanding = []

    def drain(self):
        """Yield (summary, Group ref) until nothing is in flight."""
        while self.num_in_flight:
            yield from self.next_done(POLL_INTERVAL_S)

    def next_done(self, timeout_s: float) -> list[tuple[GroupSummary, ray.ObjectRef]]:
        """What finished within `timeout_s` (at most `POLL_INTERVAL_S`), in completion order:
        (summary, ref of the Group). Also moves failures on: re-sends what a failed replica had not
        answered; raises NoLiveEngineError once no replica can answer the rest."""
        replicas = self.router.replicas
        self._send()
        if self.outstanding and not replicas.reviving():
            raise NoLiveEngineError(replicas.no_live_message([r.prompt_id for r, _ in self.outstanding]))
        if not self.streams:
            replicas.poll(timeout_s=min(timeout_s, POLL_INTERVAL_S))
            return []
        revivals = replicas.revival_refs()
        # fetch_local=False: readiness only; a Group must not be copied to the driver's node.
        ready, _ = ray.wait(list(self.streams) + revivals, num_returns=1, timeout=min(timeout_s, POLL_INTERVAL_S),
                            fetch_local=False)
        replicas.poll(timeout_s=0)  # consume finished revivals, or the wait above spins
        done = []
        for stream in [s for s in ready if s in self.streams]:
            confirmed = self._take(stream)
            if confirmed is not None:
                done.append(confirmed)
        self.outstanding += self.watchdog.check(self)
        return done

    def _take(self, stream) -> tuple[GroupSummary, ray.ObjectRef] | None:
        """Read the next item of a ready stream; a confirmed group, or None (a Group whose summary
        is still to come, a stream that ended, a replica that failed)."""
        index, incarnation, held_version = self.streams[stream]
        try:
            confirmed = read_item(stream, self.unconfirmed, self.router.call_timeout_s)
        except StopIteration:
            del self.streams[stream]
            self.outstanding += self.pending.pop(stream).values()  # an engine never drops one; defensive
            return None
        except ray.exceptions.RayError as error:
            if isinstance(error, ray.exceptions.RayTaskError) and not is_engine_dead(error):
                raise  # a caller error (e.g. generate while asleep), not a dead replica
            if not isinstance(error, (ray.exceptions.RayTaskError, ray.exceptions.RayActorError, *LOST_RESULT_ERRORS)):
                raise  # not a replica's fault
            lost = "a result could not be read: " if isinstance(error, LOST_RESULT_ERRORS) else ""
            self.router.replicas.mark_failed(index, lost + error_text(error), incarnation, kill=is_engine_dead(error))
            self.outstanding += self.drop_replica(index)
            return None
        self.watchdog.progressed(index)
        if confirmed is None:
            return None
        summary, _ = confirmed
        if summary.policy_versions and summary.policy_versions[0] < held_version:
            # Ray restarted the actor between two calls (it came back with the initial weights):
            # this group is not the policy's; reload the replica and re-send.
            self.router.replicas.mark_failed(index, f"restarted unseen: group {summary.group_id!r} carries policy "
                                                    f"version {summary.policy_versions[0]}, the replica held "
                                                    f"{held_version}", incarnation)
            self.outstanding += self.drop_replica(index)
            return None
        self.pending[stream].pop(summary.group_id)
        return confirmed

    def drop_replica(self, index: int) -> list[tuple]:
        """Forget every stream of replica `index`; returns the requests they had not answered."""
        lost = []
        for stream in [s for s, (i, _, _) in self.streams.items() if i == index]:
            del self.streams[stream]
            self.unconfirmed.pop(stream, None)
            lost += self.pending.pop(stream).values()
        self.router.count_resent(len(lost))
        return lost

    def close(self, timeout_s: float = 30.0) -> None:
        """Abort what is still in flight and read the streams out (within `timeout_s`): the engines
        are left with nothing of this stream running, as engines kept for another run must be."""
        by_replica: dict[int, list[str]] = {}
        for stream, requests in self.pending.items():
            by_replica.setdefault(self.streams[stream][0], []).extend(requests)
        self.outstanding = []
        for index, group_ids in by_replica.items():
            self.router.engines[index].abort.remote(group_ids)
        deadline = time.monotonic() + timeout_s
        while self.streams and time.monotonic() < deadline:
            try:
                self.next_done(min(POLL_INTERVAL_S, max(deadline - time.monotonic(), 0.0)))
            except (ray.exceptions.RayError, NoLiveEngineError):
                break  # a failing replica is the router's to revive; nothing here is wanted any more
            self.outstanding = []  # what a failed replica had is not sent again


def read_item(stream, unconfirmed: dict, timeout_s: float) -> tuple[GroupSummary, ray.ObjectRef] | None:
    """Take the next item of an engine's stream: a Group's ref (kept unread), or the summary that
    confirms it; returns both once the summary is in. Raises the engine's error, and StopIteration
    at the end of the stream."""
    try:
        ref = next(stream)
    except StopIteration:
        last = unconfirmed.pop(stream, None)
        if last is not None:
            ray.get(last, timeout=timeout_s)  # a failed stream ends with its error in a Group's place: raise it
        raise
    if stream not in unconfirmed:
        unconfirmed[stream] = ref
        return None
    return ray.get(ref, timeout=timeout_s), unconfirmed.pop(stream)
