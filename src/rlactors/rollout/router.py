"""RolloutRouter: data parallelism over N RolloutEngine replicas, in the driver process.

    router = RolloutRouter.create(model_path, rollout_config, max_restarts=1)
    router.ready()                                       # EngineStartError names a replica that fails
    for summary, group_ref in router.generate_refs(requests, sampling):  # completion order
        ...                                              # the Group stays in the object store
    stream = router.stream(); stream.add(requests)       # added to at any time (rollout/stream.py)
    for group in router.generate(requests, sampling):    # the same, each Group fetched here
        ...
    router.update_weights(named_tensors, policy_version) # all live replicas, sent from here
    router.health()                                      # one dict per replica

A plain object, not an actor: it only moves object refs, and living in the driver means it dies
with the run rather than holding requests nobody will collect. Of each finished group it reads only
the engine's `GroupSummary` (ids, lengths, finish reasons, versions); the Group is a streaming
result of the engine call, so it belongs to the driver, sits in the object store of the engine's
node (`rlactors.runtime.transport`) and stays readable if the engine dies after yielding it.

Guarantees: every request yields exactly one Group, or the call raises. A replica fails when its
actor dies, its vLLM engine dies (EngineDeadError: the actor is killed so Ray restarts it), one of
its results is lost (ObjectLostError and kin), or it hangs: a replica whose streams yield nothing
for `stall_timeout_s` is asked `health()`, and one that does not answer within `health_timeout_s`
is killed (an engine busy with long responses answers, and is left alone); so is one whose engine
core made no progress between two such probes `stall_timeout_s` apart while samples were in flight
and nothing paused them (its actor answers, its core does not: `health()`'s output count). An actor Ray restarted
between two calls comes back with the initial weights: its first group's tokens carry a version
older than the one it held, and it is failed like the others (that group is not yielded). The
requests a failed replica had not returned are re-sent to live replicas from scratch. If replicas
were created with
`max_restarts > 0`, Ray restarts a failed one; the router then has the current weights loaded into it
(`set_weight_loader`: in a run, a sync from the trainer; no copy is kept) before it gets work again.
In async mode that sync may run after an update the driver has not published yet: the replica then
holds weights newer than the version they are labelled with, so its tokens' staleness is counted
high, never low. The load must finish within `call_timeout_s`, queued trainer work included. A
replica that does not come back within `start_timeout_s` is given up. Once no replica is live and
none is coming back, `NoLiveEngineError` names each replica, its state, failures and last error.
A request the engine itself refuses (a prompt too long, bad token ids) comes back as a Group of
"error" samples naming its prompt_id: never silently dropped.

Bounds: `ready()` waits at most `start_timeout_s`; sleep, wake-up and state loads at most
`call_timeout_s`, and so does each call of a weight sync (`rlactors.weight_sync.client`). A replica
that dies or hangs during one of them is marked failed (a hung one killed, for Ray to restart) and
the call goes on with the others.

Threads: in async mode the producer thread reads its stream while the trainer thread syncs
weights (`weight_sync_targets` / `weight_sync_done`; validation generates too). The replicas' states, failures and revivals live
in `rlactors.rollout.replicas.Replicas`, which locks them; what a `GenerationStream` tracks (its
engine calls, their pending requests, the watchdog's timers) is its own, touched by one thread.
Which replica a request goes to: the one with the fewest tokens in flight (`rlactors.rollout.stream`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import ray

from rlactors.config import RolloutConfig, SamplingConfig
from rlactors.rollout.engine import create_engine
from rlactors.rollout.faults import LOST_RESULT_ERRORS, EngineStartError, NoLiveEngineError, is_engine_dead
from rlactors.rollout.replicas import Replicas
from rlactors.rollout.samples import GroupSummary, SamplingArg
from rlactors.rollout.stream import GenerationStream
from rlactors.runtime.calls import error_text, gather, get_within
from rlactors.runtime.phases import PHASE_LOG_TIMEOUT_S
from rlactors.types import Group, PromptRequest

__all__ = ["RolloutRouter", "NoLiveEngineError", "EngineStartError"]


class RolloutRouter:
    def __init__(self, engines: list, policy_version: int = 0, *, start_timeout_s: float = 600.0,
                 call_timeout_s: float = 900.0, stall_timeout_s: float = 300.0, health_timeout_s: float = 60.0,
                 default_sampling: SamplingConfig | None = None):
        """The bounds are `RolloutConfig`'s fields of the same names (`create` passes them);
        `default_sampling` is what the engines use for a request without its own (`rollout.sampling`)."""
        self.default_sampling = default_sampling or SamplingConfig()
        self.replicas = Replicas(engines, policy_version, start_timeout_s, call_timeout_s)
        self.engines = self.replicas.engines
        self.start_timeout_s, self.call_timeout_s = start_timeout_s, call_timeout_s
        self.stall_timeout_s, self.health_timeout_s = stall_timeout_s, health_timeout_s
        self._lock = threading.Lock()  # the two counters below
        self.num_resent = 0
        self.num_health_probes = 0  # health() calls sent to replicas whose streams were quiet
        self._sender = None  # `update_weights`' sender, made at its first call

    @classmethod
    def create(cls, model_path: str, config: RolloutConfig, max_restarts: int = 0, placement=None, **engine_options):
        """`config.num_engines` engines; `placement` (a `rlactors.placement.cluster.Placement`) puts
        each in its bundles of the run's plan."""
        engines = [create_engine(model_path, config, max_restarts=max_restarts, **engine_options,
                                 placement_options=placement.engine_options(i) if placement is not None else None)
                   for i in range(config.num_engines)]
        return cls.over(engines, config)

    @classmethod
    def over(cls, engines: list, config: RolloutConfig):
        """A router over engines already started (kept from another run), with `config`'s bounds."""
        return cls(engines, start_timeout_s=config.start_timeout_s, call_timeout_s=config.call_timeout_s,
                   stall_timeout_s=config.stall_timeout_s, health_timeout_s=config.health_timeout_s,
                   default_sampling=config.sampling)

    @property
    def policy_version(self) -> int:
        return self.replicas.policy_version

    # ---------------------------------------------------------------- replicas

    def ready(self) -> list[dict]:
        """Start every engine, within `start_timeout_s`. If any fails or does not answer in time,
        every engine is killed and EngineStartError names each such replica with its error."""
        started = gather({index: engine.ready.remote() for index, engine in enumerate(self.engines)},
                         self.start_timeout_s)
        problems = {index: error_text(error) for index, error in started.errors.items()}
        problems.update({index: f"did not start within {self.start_timeout_s:g} s (rollout.start_timeout_s)"
                         for index in started.not_answered})
        if problems:
            problems = dict(sorted(problems.items()))
            self.replicas.mark_dead(problems)
            for engine in self.engines:  # the run cannot start: nothing may keep their resources
                ray.kill(engine)
            raise EngineStartError(f"{len(problems)} of {len(self.engines)} rollout engine(s) failed to start:\n"
                                   + "\n".join(f"  replica {i}: {problem}" for i, problem in problems.items()))
        self.replicas.note_pids(started.values)
        return self.health()

    def health(self) -> list[dict]:
        """One dict per replica: replica, state, num_failures, last_error."""
        return self.replicas.health()

    def live_replicas(self) -> list[int]:
        return [index for index, _ in self.replicas.live()]

    def reviving(self) -> bool:
        return self.replicas.reviving()

    def wait_until_healthy(self, timeout_s: float = 300.0) -> list[dict]:
        """Block until no replica is restarting or loading weights (or the timeout passes)."""
        deadline = time.monotonic() + timeout_s
        while self.replicas.reviving() and time.monotonic() < deadline:
            self.replicas.poll(timeout_s=min(1.0, max(0.0, deadline - time.monotonic())))
        return self.health()

    # ---------------------------------------------------------------- generation

    def generate(self, requests: list[PromptRequest], sampling: SamplingArg | list[SamplingArg] = None
                 ) -> Iterator[Group]:
        """Yield one Group per request, in completion order, each fetched into this process (for
        validation, notebooks, tests; a training step uses `generate_refs`)."""
        refs = self.generate_refs(requests, sampling)  # requests are in flight from here on
        return (get_within(group_ref, self.call_timeout_s, f"rollout group {summary.group_id!r}")
                for summary, group_ref in refs)

    def generate_refs(self, requests: list[PromptRequest], sampling: SamplingArg | list[SamplingArg] = None
                      ) -> Iterator[tuple[GroupSummary, ray.ObjectRef]]:
        """Yield (summary, ref of the Group) once per request, in completion order, across the live
        replicas. Only the summary is read here; pass the ref on (scorers, buffer) unread. Raises
        NoLiveEngineError once no replica can answer the rest."""
        stream = self.stream()
        stream.add(requests, sampling)
        return stream.drain()  # requests are in flight from here on

    def stream(self) -> GenerationStream:
        """An open stream to add requests to at any time and take Groups from as they finish
        (`rlactors.rollout.stream`)."""
        return GenerationStream(self)

    def count_health_probe(self) -> None:
        with self._lock:
            self.num_health_probes += 1

    def count_resent(self, num_requests: int) -> None:
        with self._lock:
            self.num_resent += num_requests

    # ---------------------------------------------------------------- weights, sleep, state

    def weight_sync_targets(self, policy_version: int) -> dict[int, tuple[object, int]]:
        """Begin a sync to `policy_version`: the live replicas, index -> (engine, incarnation), for a
        sender (`rlactors.weight_sync`). A replica reviving meanwhile loads this version itself."""
        live = self.replicas.publish(policy_version)
        return {index: (self.engines[index], incarnation) for index, incarnation in live}

    def weight_sync_done(self, targets: dict[int, tuple[object, int]], stats: dict) -> None:
        """Record a sync's outcome: each engine it reached holds `stats["policy_version"]`; one it
        failed on is killed unless its actor died (its update may be half done) and revived by Ray
        with the current weights."""
        failed, synced = stats.get("failed") or {}, set(stats.get("synced", ()))
        for index, (_, incarnation) in targets.items():
            if index in synced:
                self.replicas.confirm_loaded(index, incarnation, stats["policy_version"])
            else:
                # An actor that died is being restarted by Ray already: a kill would cost a restart.
                reason = failed.get(index) or "the sync did not reach it"
                self.replicas.mark_failed(index, f"weight sync: {reason}", incarnation,
                                          kill=index not in stats.get("actor_died", ()))

    def set_weight_loader(self, loader) -> None:
        """How a revived replica gets the current weights: `loader(targets, policy_version)` returns
        an ObjectRef of the sync's figures (a trainer group's `send_weights_ref`)."""
        self.replicas.weight_loader = loader

    def update_weights(self, named_tensors, policy_version: int, transport: str = "object_store",
                       bucket_bytes: int = 64 << 20, verify: bool = False) -> dict:
        """Send (HF name, tensor) pairs from this process to every live replica (tests and notebooks;
        in a run the trainer sends its own weights). Names are the checkpoint's: an MoE model's fused
        experts go through `rlactors.models.moe.checkpoint_layout(model)` first. Returns the sync's figures (`WeightSender`).
        A replica revived later pulls the same pairs from the object store (`load_weights`): the
        router keeps a reference to the caller's pairs, which are the caller's to change."""
        from rlactors.weight_sync.choice import WeightSyncSettings
        from rlactors.weight_sync.sender import WeightSender

        pairs = list(named_tensors)
        if self._sender is None:
            self._sender = WeightSender(rank=0)
        targets = self.weight_sync_targets(policy_version)
        settings = WeightSyncSettings(transport, bucket_bytes, None, self.call_timeout_s, verify=verify)
        stats = self._sender.send(lambda: iter(pairs), targets, policy_version, settings)
        self.weight_sync_done(targets, stats)

        def reload(revived: dict, version: int):
            ((engine, _),) = revived.values()
            return engine.load_weights.remote([ray.put(pairs)], version)

        self.set_weight_loader(reload)
        return stats

    def sleep(self) -> None:
        self._call(self.replicas.live(), "sleep")

    def abort(self) -> None:
        """End whatever every live replica generates now (its groups come back aborted)."""
        self._call(self.replicas.live(), "abort", None)

    def new_run(self, config: RolloutConfig | None = None) -> None:
        """Every replica serves a new run from policy_version 0, with that run's `config` (engines
        kept from another run; they refuse to generate until this run's first weight sync)."""
        self.replicas.run_settings = config
        self._call(self.replicas.live(), "new_run", config)

    def stop_weight_transfer(self) -> None:
        """Every live replica leaves its weight-transfer engine (an NCCL group, mapped segments), as
        engines kept after their trainer is gone must: the next run's trainer sets up its own."""
        self._call(self.replicas.live(), "shutdown_weight_transfer")

    def wake_up(self) -> None:
        """Wake whatever still sleeps: after a weight sync into sleeping engines, the KV cache."""
        self._call(self.replicas.live(), "wake_up")

    def phase_logs(self) -> list[list[dict] | None]:
        """Each replica's phase log (see `rlactors.runtime.phases`), None for replicas that are not live."""
        logs = self._call(self.replicas.live(), "phase_log", timeout_s=PHASE_LOG_TIMEOUT_S)
        return [logs.get(i) for i in range(len(self.engines))]

    def clocks(self) -> dict:
        """The live engines' clocks since their run began, the mean over replicas: `time_s`, seconds
        generating, paused (weight updates, sleep) and idle (`health()["time_s"]`), and
        `running_request_s`, running requests x seconds, with their `max_num_seqs` (for
        `rollout_occupancy`); {} when none is live."""
        answers = list(self._call(self.replicas.live(), "health", timeout_s=self.health_timeout_s).values())
        if not answers:
            return {}
        times = [answer["time_s"] for answer in answers]
        return {"time_s": {state: sum(t[state] for t in times) / len(times) for state in times[0]},
                "running_request_s": sum(a["running_request_s"] for a in answers) / len(answers),
                "max_num_seqs": max(a["max_num_seqs"] for a in answers)}

    def capacity(self) -> int:
        """Sequences the live engines run at once, together (their `max_num_seqs`); 0 when none is live."""
        answers = self._call(self.replicas.live(), "health", timeout_s=self.health_timeout_s).values()
        return sum(answer["max_num_seqs"] for answer in answers)

    def state_dict(self) -> dict:
        """The policy_version only; weights are the trainer's to resend after a restore."""
        return {"policy_version": self.policy_version}

    def load_state_dict(self, state: dict) -> None:
        # A replica revived now gets the restored weights with the sync that follows a restore.
        policy_version = int(state["policy_version"])
        live = self.replicas.publish(policy_version)
        results = self._call(live, "load_state_dict", state)
        for index, incarnation in live:
            if index in results:
                self.replicas.confirm_loaded(index, incarnation, policy_version)

    def _call(self, live: list[tuple[int, int]], method: str, *args, timeout_s: float | None = None) -> dict:
        """`method(*args)` on each (replica, incarnation) in `live`, within `timeout_s` (default
        `call_timeout_s`): {replica: result}. A replica that dies (or whose vLLM engine dies) is
        marked failed and left out, and so is one that hangs in the call (not answered within the
        bound: it is killed, and Ray restarts it with the current weights like a hung generation);
        an engine's own exception is raised, noting the replica."""
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        if not live:
            return {}
        incarnations = dict(live)
        results, errors, stuck = gather({index: getattr(self.engines[index], method).remote(*args)
                                         for index, _ in live}, timeout_s)
        for index, error in errors.items():
            if isinstance(error, ray.exceptions.RayTaskError):  # first: one whose cause is a lost object is the engine's
                if not is_engine_dead(error):
                    error.add_note(f"in rollout replica {index}'s {method}()")
                    raise error
                self.replicas.mark_failed(index, f"{method}: {error_text(error)}", incarnations[index], kill=True)
            elif isinstance(error, (ray.exceptions.RayActorError, *LOST_RESULT_ERRORS)):
                self.replicas.mark_failed(index, f"{method}: {error_text(error)}", incarnations[index])
            else:
                raise error
        for index in stuck:
            self.replicas.mark_failed(index, f"{method}: hung, no answer within {timeout_s:g} s (rollout.call_timeout_s)",
                                      incarnations[index], kill=True)
        return results

