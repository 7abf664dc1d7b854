"""RolloutRouter: data parallelism over N RolloutEngine replicas, in the driver process.

    router = RolloutRouter.create(model_path, rollout_config, max_restarts=1)
    router.ready()
    for summary, group_ref in router.generate_refs(requests, sampling):  # completion order
        ...                                              # the Group stays in the object store
    for group in router.generate(requests, sampling):    # the same, each Group fetched here
        ...
    router.update_weights(bucket_refs, policy_version)   # all live replicas
    router.health()                                      # one dict per replica

A plain object, not an actor: it only moves object refs, and living in the driver means it dies
with the run rather than holding requests nobody will collect. Of each finished group it reads only
the engine's `GroupSummary` (ids, lengths, finish reasons, versions); the Group is a streaming
result of the engine call, so it belongs to the driver, sits in the object store of the engine's
node (`rlactors.transport`) and stays readable if the engine dies after yielding it.

Guarantees: every request yields exactly one Group. A replica that dies (or whose vLLM engine
dies) mid-batch is marked dead and the requests it had not returned are re-sent to live replicas
from scratch. If replicas were created with `max_restarts > 0`, Ray restarts a dead one; the router
then loads the current weights into it (it keeps the last `update_weights` buckets as object refs
for this) before it gets work again. If no replica is live and none is restarting, the remaining
requests come back as error Groups naming their prompt_id: never silently dropped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import ray

from rlactors.config import RolloutConfig
from rlactors.phases import PHASE_LOG_TIMEOUT_S
from rlactors.rollout.engine import create_engine
from rlactors.rollout.samples import GroupSummary, SamplingArg, error_group, summarize_group
from rlactors.types import Group, PromptRequest
from rlactors.waits import get_within

HEALTHY, DEAD, RESTARTING, LOADING = "healthy", "dead", "restarting", "loading"


class RolloutRouter:
    def __init__(self, engines: list, policy_version: int = 0):
        self.engines = list(engines)
        self.states = [HEALTHY] * len(engines)
        self.num_failures = [0] * len(engines)
        self.num_resent = 0
        self.policy_version = policy_version
        self.weight_buckets: list | None = None  # refs of the last update, to reload restarted replicas
        self._revivals: dict[int, ray.ObjectRef] = {}  # replica -> pending ready() or update_weights()
        self._retry_at: dict[int, float] = {}  # restarting replica -> when to ask ready() again

    @classmethod
    def create(cls, model_path: str, config: RolloutConfig, max_restarts: int = 0, placement=None, **engine_options):
        """`config.num_engines` engines; `placement` (a `rlactors.placement.cluster.Placement`) puts
        each in its bundles of the run's plan."""
        engines = [create_engine(model_path, config, max_restarts=max_restarts, **engine_options,
                                 placement_options=placement.engine_options(i) if placement is not None else None)
                   for i in range(config.num_engines)]
        return cls(engines)

    # ---------------------------------------------------------------- replicas

    def ready(self) -> list[dict]:
        """Start every engine; a replica that fails to start is marked dead."""
        refs = [engine.ready.remote() for engine in self.engines]
        for index, ref in enumerate(refs):
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                self._mark_failed(index)
        return self.health()

    def health(self) -> list[dict]:
        return [
            {"replica": i, "state": self.states[i], "num_failures": self.num_failures[i]}
            for i in range(len(self.engines))
        ]

    def live_replicas(self) -> list[int]:
        self._poll_revivals(timeout_s=0)
        return [i for i, state in enumerate(self.states) if state == HEALTHY]

    def _mark_failed(self, index: int) -> None:
        self.num_failures[index] += 1
        self.states[index] = RESTARTING
        self._ask_ready(index)

    def _ask_ready(self, index: int) -> None:
        # Answers once Ray has restarted the actor (max_restarts > 0); fails with
        # ActorUnavailableError while it is restarting (asked again a second later) and with
        # ActorDiedError once it has no restarts left (the replica is then dead).
        self._retry_at.pop(index, None)
        self._revivals[index] = self.engines[index].ready.remote()

    def reviving(self) -> bool:
        return bool(self._revivals or self._retry_at)

    def _poll_revivals(self, timeout_s: float) -> None:
        for index, retry_at in list(self._retry_at.items()):
            if time.monotonic() >= retry_at:
                self._ask_ready(index)
        if not self._revivals:
            time.sleep(min(timeout_s, 0.5) if self._retry_at else 0)
            return
        ready, _ = ray.wait(list(self._revivals.values()), num_returns=1, timeout=timeout_s)
        for index, ref in list(self._revivals.items()):
            if ref not in ready:
                continue
            del self._revivals[index]
            try:
                ray.get(ref)
            except ray.exceptions.ActorUnavailableError:
                self._retry_at[index] = time.monotonic() + 1.0
                continue
            except ray.exceptions.RayError:
                self.states[index] = DEAD
                continue
            if self.states[index] == RESTARTING:
                # A restarted actor holds the initial checkpoint at version 0: bring it up to date
                # before it gets work.
                self.states[index] = LOADING
                engine = self.engines[index]
                self._revivals[index] = (
                    engine.update_weights.remote(self.weight_buckets, self.policy_version)
                    if self.weight_buckets is not None
                    else engine.load_state_dict.remote({"policy_version": self.policy_version})
                )
            else:
                self.states[index] = HEALTHY

    def wait_until_healthy(self, timeout_s: float = 300.0) -> list[dict]:
        """Block until no replica is restarting or loading weights (or the timeout passes)."""
        deadline = time.monotonic() + timeout_s
        while self.reviving() and time.monotonic() < deadline:
            self._poll_revivals(timeout_s=min(1.0, max(0.0, deadline - time.monotonic())))
        return self.health()

    # ---------------------------------------------------------------- generation

    def generate(self, requests: list[PromptRequest], sampling: SamplingArg | list[SamplingArg] = None
                 ) -> Iterator[Group]:
        """Yield one Group per request, in completion order, each fetched into this process (for
        validation, notebooks, tests; a training step uses `generate_refs`)."""
        refs = self.generate_refs(requests, sampling)  # requests are in flight from here on
        return (ray.get(group_ref) for _, group_ref in refs)

    def generate_refs(self, requests: list[PromptRequest], sampling: SamplingArg | list[SamplingArg] = None
                      ) -> Iterator[tuple[GroupSummary, ray.ObjectRef]]:
        """Yield (summary, ref of the Group) once per request, in completion order, across the live
        replicas. Only the summary is read here; pass the ref on (scorers, buffer) unread."""
        settings = sampling if isinstance(sampling, list) else [sampling] * len(requests)
        if len(settings) != len(requests):
            raise ValueError(f"got {len(settings)} sampling settings for {len(requests)} requests")
        group_ids = [r.group_id for r in requests]
        if len(set(group_ids)) != len(group_ids):
            duplicates = sorted({g for g in group_ids if group_ids.count(g) > 1})
            raise ValueError(f"duplicate group_ids in one batch: {duplicates[:5]}")

        pending: dict = {}  # ObjectRefGenerator -> {group_id: (request, sampling)} not yet returned
        streams: dict = {}  # ObjectRefGenerator -> replica
        outstanding = self._send(list(zip(requests, settings, strict=True)), pending, streams)
        return self._collect(outstanding, pending, streams)  # requests are in flight from here on

    def _send(self, outstanding: list[tuple], pending: dict, streams: dict) -> list[tuple]:
        """Spread (request, sampling) pairs over the live replicas; returns what could not be sent."""
        live = self.live_replicas()
        for slot, index in enumerate(live):
            share = outstanding[slot :: len(live)]
            if share:
                stream = self.engines[index].generate.remote([r for r, _ in share], [s for _, s in share],
                                                             with_summaries=True)
                streams[stream] = index
                pending[stream] = {r.group_id: (r, s) for r, s in share}
        return [] if live else outstanding

    def _collect(self, outstanding: list[tuple], pending: dict, streams: dict
                 ) -> Iterator[tuple[GroupSummary, ray.ObjectRef]]:
        # An engine streams each Group, then its summary: the summary confirms the Group before it
        # (an engine that dies in between ends its stream with an error in the summary's place).
        unconfirmed: dict = {}  # ObjectRefGenerator -> ref of the Group whose summary comes next
        while outstanding or streams:
            if outstanding:
                outstanding = self._send(outstanding, pending, streams)
            if outstanding and not self.reviving():
                for request, sampling in outstanding:  # nobody can ever answer these
                    num_samples = getattr(sampling, "num_samples_per_prompt", None) or (
                        sampling.get("num_samples_per_prompt", 1) if isinstance(sampling, dict) else 1)
                    group = error_group(request, num_samples, f"prompt_id={request.prompt_id!r}: no live rollout engine")
                    yield summarize_group(group), ray.put(group)
                outstanding = []
            if not streams:
                self._poll_revivals(timeout_s=1.0)
                continue
            # fetch_local=False: readiness only; a Group must not be copied to the driver's node.
            ready, _ = ray.wait(list(streams) + list(self._revivals.values()), num_returns=1, timeout=1.0,
                                fetch_local=False)
            self._poll_revivals(timeout_s=0)  # consume finished revivals, or the wait above spins
            for stream in [s for s in ready if s in streams]:
                index = streams[stream]
                try:
                    confirmed = self._read(stream, unconfirmed)
                except StopIteration:
                    del streams[stream]
                    outstanding += list(pending.pop(stream).values())  # an engine never drops one; defensive
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as error:
                    if isinstance(error, ray.exceptions.RayTaskError):
                        if type(error.cause).__name__ != "EngineDeadError":
                            raise  # a caller error (e.g. generate while asleep), not a dead replica
                        ray.kill(self.engines[index], no_restart=False)  # restart it if allowed
                    if self.states[index] == HEALTHY:
                        self._mark_failed(index)
                    for lost_stream in [s for s, i in streams.items() if i == index]:
                        del streams[lost_stream]
                        unconfirmed.pop(lost_stream, None)
                        lost = list(pending.pop(lost_stream).values())
                        self.num_resent += len(lost)
                        outstanding += lost
                else:
                    if confirmed is not None:
                        summary, group_ref = confirmed
                        pending[stream].pop(summary.group_id)
                        yield summary, group_ref

    @staticmethod
    def _read(stream, unconfirmed: dict) -> tuple[GroupSummary, ray.ObjectRef] | None:
        """Take the next item of an engine's stream: a Group's ref (kept unread), or the summary
        that confirms it; returns both once the summary is in. Raises the engine's error, and
        StopIteration at the end of the stream."""
        try:
            ref = next(stream)
        except StopIteration:
            last = unconfirmed.pop(stream, None)
            if last is not None:
                ray.get(last)  # a failed stream ends with its error in a Group's place: raise it
            raise
        if stream not in unconfirmed:
            unconfirmed[stream] = ref
            return None
        return ray.get(ref), unconfirmed.pop(stream)

    # ---------------------------------------------------------------- weights, sleep, state

    def update_weights(self, buckets: list, policy_version: int) -> list[dict | None]:
        """Send the buckets (values are put once into the object store) to every live replica.
        Returns each replica's timing dict, None for replicas that are not live."""
        refs = [b if isinstance(b, ray.ObjectRef) else ray.put(b) for b in buckets]
        self.weight_buckets, self.policy_version = refs, policy_version
        live = self.live_replicas()
        calls = {i: self.engines[i].update_weights.remote(refs, policy_version) for i in live}
        results: list[dict | None] = [None] * len(self.engines)
        for index, ref in calls.items():
            try:
                results[index] = ray.get(ref)
            except ray.exceptions.RayActorError:
                self._mark_failed(index)
        return results

    def sleep(self) -> None:
        ray.get([self.engines[i].sleep.remote() for i in self.live_replicas()])

    def wake_up(self) -> None:
        """Wake whatever still sleeps: after `update_weights` on sleeping engines, the KV cache."""
        ray.get([self.engines[i].wake_up.remote() for i in self.live_replicas()])

    def phase_logs(self) -> list[list[dict] | None]:
        """Each replica's phase log (see `rlactors.phases`), None for replicas that are not live."""
        live = self.live_replicas()
        logs = dict(zip(live, get_within([self.engines[i].phase_log.remote() for i in live], PHASE_LOG_TIMEOUT_S,
                                         "rollout engines' phase_log"), strict=True))
        return [logs.get(i) for i in range(len(self.engines))]

    def state_dict(self) -> dict:
        """The policy_version only; weights are the trainer's to resend after a restore."""
        return {"policy_version": self.policy_version}

    def load_state_dict(self, state: dict) -> None:
        self.policy_version = int(state["policy_version"])
        ray.get([self.engines[i].load_state_dict.remote(state) for i in self.live_replicas()])
