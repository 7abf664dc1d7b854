"""The pool of reward scorer actors, which spreads groups over them as soon as they arrive.

    pool = RewardPool(config.reward, max_response_tokens=config.rollout.sampling.max_response_tokens,
                      policy_tokenizer_path=config.model.path)  # the path: only with reward models
    scored_ref = pool.score(group_ref)            # ObjectRef[Group]; scoring starts now
    scored_refs = pool.score_many(group_refs)     # several groups per actor call
    pool.metrics()                                # {"reward/num_errors": ..., "reward/num_timeouts": ...}

Refs in, refs out: Ray resolves the group refs given as top-level arguments inside the actor, so
the driver never fetches a group to score it and scoring overlaps with generation. Scored groups
stay in the object store (`rlactors.runtime.transport`), whatever their size. What a scorer does with a
group, and how a failing function is recorded: `rlactors.reward.scorer`.

With reward models (`reward.models`) each group goes through stages, ref to ref: the function scorers,
then each model's replicas in turn (`rlactors.reward.model_scorer`), each adding its weighted part.
`offload()` / `onload()` hand the devices of the models that share them (not `own_devices`) to the
trainer and back (colocated time-sharing).
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import ray

from rlactors.config import RewardConfig, RewardModelConfig, RolloutConfig
from rlactors.placement.cluster import unplaced_options
from rlactors.reward.failures import FailureStreak
from rlactors.reward.model_scorer import RewardModelScorer, located
from rlactors.reward.scorer import COUNTERS, RewardScorer, resolve_function_spec
from rlactors.reward.worker import kill_process_group, noted_worker
from rlactors.rollout.engine import create_engine
from rlactors.runtime.calls import error_text, gather, get_within
from rlactors.runtime.transport import results_in_object_store
from rlactors.types import Group

__all__ = ["RewardPool"]

# Closing a scorer stops its worker: a fraction of a second; past this the actor is stuck.
CLOSE_TIMEOUT_S = 20.0
# Starting a scorer imports sympy and the user's module in its worker (see WORKER_STARTUP_TIMEOUT_S).
STARTUP_TIMEOUT_S = 300.0
# Counters and state are read between scoring calls, which a scorer runs one at a time: the bound
# covers the calls queued before it (each sample of each at most `reward.timeout_s`).
STATE_TIMEOUT_S = 600.0


def _is_worker_group(pid: int) -> bool:
    """Whether the process group `pid` is still the reward worker's. A pid recorded earlier may since
    belong to another process: the group is the worker's if its leader is a reward worker, or if the
    leader is gone (Ray SIGKILLs an actor's children when it kills the actor, so the worker may be
    dead with the user function's children left in its group; Linux gives no new process a pid that
    is a live group's id, so a dead leader's id names its own group or none)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text(errors="replace").rsplit(")", 1)[1].split()[0]
        command = Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except OSError:  # gone
        return True
    # An empty command line: the leader is exiting (killed, its memory already torn down) or is a
    # kernel thread (which leads no group a kill could reach).
    return state in ("Z", "X") or not command or "worker_main" in command


class RewardPool:
    """N `RewardScorer` actors; each call goes to the actor with the fewest groups in flight."""

    def __init__(self, config: RewardConfig, max_response_tokens: int | None = None,
                 policy_tokenizer_path: str | None = None, placement=None) -> None:
        """`placement` (a `rlactors.placement.Placement`): the run's, which places each reward model
        replica on its device; without it (a notebook, evaluation) a replica takes a whole GPU on a
        cluster with GPUs."""
        overlong_buffer_tokens = None
        if config.overlong.enable:
            if max_response_tokens is None or config.overlong.buffer_tokens > max_response_tokens:
                raise ValueError(
                    f"reward.overlong.buffer_tokens ({config.overlong.buffer_tokens}) must be at most "
                    f"max_response_tokens ({max_response_tokens})"
                )
            overlong_buffer_tokens = config.overlong.buffer_tokens
        if config.models and policy_tokenizer_path is None:
            raise ValueError("reward.models: the pool needs the policy's tokenizer path to give the models its prompts")
        models = [located(index, model) for index, model in enumerate(config.models)]
        self.max_groups_per_call = config.max_groups_per_call
        custom_function = resolve_function_spec(config.custom_function)
        self.actors = [
            RewardScorer.options(**results_in_object_store({"num_cpus": config.num_cpus_per_worker})).remote(
                custom_function,
                config.gsm8k_mode,
                config.timeout_s,
                max_response_tokens,
                overlong_buffer_tokens,
                config.overlong.penalty_factor,
                config.function_weight,
                bool(config.models),
                config.function_data_sources,
            )
            for _ in range(config.num_workers)
        ]
        # Each model's replicas: one stage after the function scorers (`self.actors`); a judge's
        # replica is a scorer over an engine of its own.
        self.model_names = [model.name for model in config.models]
        started = [[start_model_replica(model, replica, policy_tokenizer_path, placement)
                    for replica in range(model.num_replicas)] for model in models]
        self.model_actors = [[scorer for scorer, _ in replicas] for replicas in started]
        self.model_engines = [engine for replicas in started for _, engine in replicas if engine is not None]
        # Replicas on devices the trainer uses too (colocated: time-shared, `offload`), and how long
        # moving them may take (the calls queued before, and a judge's engine going to sleep or waking).
        self.shared_replicas = [replica for model, replicas in zip(models, self.model_actors, strict=True)
                                if not model.own_devices for replica in replicas]
        self.move_timeout_s = STATE_TIMEOUT_S + max([model.judge.call_timeout_s for model in models], default=0.0)
        self.in_flight: list[list[tuple[ray.ObjectRef, int]]] = [[] for _ in self.actors]
        self.model_in_flight = [[[] for _ in replicas] for replicas in self.model_actors]
        # In async mode the producer thread scores rollouts while the trainer loop's scores validation.
        self.dispatch_lock = threading.Lock()
        self.failures = FailureStreak(config.max_failed_steps)
        # Startup errors surface here. Each scorer's note of its current worker's pid (a timeout or a
        # restart of the actor starts a new worker, which replaces the note).
        try:
            self.worker_notes: list[tuple[str, str | None]] = get_within(
                [actor.worker_note.remote() for actor in self.actors], STARTUP_TIMEOUT_S, "reward scorer startup"
            )
            for model, replicas in zip(models, self.model_actors, strict=True):
                get_within([replica.ready.remote() for replica in replicas], startup_timeout_s(model),
                           f"reward model {model.name!r} startup")
        except BaseException:
            for actor in [*self._all_actors(), *self.model_engines]:  # nobody else holds them yet: a failed
                ray.kill(actor)                                       # pool leaves no scorer or engine behind
            raise

    def score(self, group: Group | ray.ObjectRef) -> ray.ObjectRef:
        """Ref to the scored copy of `group` (a Group or a ref to one)."""
        return self._score_call([group])[0]

    def score_many(self, groups: list[Group | ray.ObjectRef]) -> list[ray.ObjectRef]:
        """Refs to the scored copies, in order; up to `max_groups_per_call` groups per actor call,
        spread over the actors."""
        per_call = max(1, min(self.max_groups_per_call, math.ceil(len(groups) / len(self.actors))))
        chunks = [groups[start:start + per_call] for start in range(0, len(groups), per_call)]
        return [ref for chunk in chunks for ref in self._score_call(chunk)]

    def _score_call(self, groups: list[Group | ray.ObjectRef]) -> list[ray.ObjectRef]:
        """Refs to the scored copies of `groups`, one call per stage on its least loaded actor."""
        refs = _call_least_loaded(self.actors, self.in_flight, groups, self.dispatch_lock)
        for replicas, in_flight in zip(self.model_actors, self.model_in_flight, strict=True):
            refs = _call_least_loaded(replicas, in_flight, refs, self.dispatch_lock)
        return refs

    def metrics(self) -> dict[str, float]:
        """Cumulative counters summed over the actors (reward/num_errors counts timeouts too)."""
        total: dict[str, float] = {}
        for metrics in get_within([actor.metrics.remote() for actor in self._all_actors()], STATE_TIMEOUT_S,
                                  "reward scorers' metrics"):
            for key, value in metrics.items():
                total[key] = total.get(key, 0.0) + value
        return total

    def state_dict(self) -> dict[str, Any]:
        """The counters summed over actors (so a resume may change num_workers)."""
        states = get_within([actor.state_dict.remote() for actor in self.actors], STATE_TIMEOUT_S,
                            "reward scorers' state_dict")
        counts = {name: sum(state["counts"][name] for state in states) for name in COUNTERS}
        models = {}
        for name, replicas in zip(self.model_names, self.model_actors, strict=True):
            replica_states = get_within([replica.state_dict.remote() for replica in replicas], STATE_TIMEOUT_S,
                                        f"reward model {name!r} state_dict")
            models[name] = {"counts": {key: sum(state["counts"][key] for state in replica_states)
                                       for key in replica_states[0]["counts"]},
                            "scoring_s": sum(state["scoring_s"] for state in replica_states)}
        return {"counts": counts, "scoring_s": sum(state["scoring_s"] for state in states), "models": models}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The first actor takes the totals, the others start from zero."""
        empty = {"counts": dict.fromkeys(COUNTERS, 0), "scoring_s": 0.0}
        get_within([actor.load_state_dict.remote(state if i == 0 else empty) for i, actor in enumerate(self.actors)],
                   STATE_TIMEOUT_S, "reward scorers' load_state_dict")
        # A model the checkpoint does not know (added on resume) starts from zero; one it knows and this
        # run has not is left out of the checkpoints from now on.
        empty_model = {"counts": {}, "scoring_s": 0.0}  # each counter from zero
        for name, replicas in zip(self.model_names, self.model_actors, strict=True):
            saved = state.get("models", {}).get(name, empty_model)
            get_within([replica.load_state_dict.remote(saved if i == 0 else empty_model)
                        for i, replica in enumerate(replicas)], STATE_TIMEOUT_S, f"reward model {name!r} load_state_dict")

    def offload(self) -> int:
        """The shared replicas give their devices up (a classifier's weights to host memory, a judge's
        engine asleep) while the trainer runs; returns the bytes moved. No-op without such replicas."""
        return sum(get_within([replica.offload.remote() for replica in self.shared_replicas], self.move_timeout_s,
                              "reward models' offload"))

    def onload(self) -> int:
        """The shared replicas take their devices back, before the next rollout (`offload`'s inverse)."""
        return sum(get_within([replica.onload.remote() for replica in self.shared_replicas], self.move_timeout_s,
                              "reward models' onload"))

    def check_step(self, num_samples: int, num_score_errors: int, first_score_error: str | None) -> None:
        """Count one training step's scoring outcome (the buffer's summary of the batch: no Group
        reaches the driver); raises ScoringFailedError naming the streak's first error once every
        sample failed for `reward.max_failed_steps` steps in a row."""
        self.failures.record(num_samples, num_score_errors, first_score_error)

    def shutdown(self) -> None:
        """Close every scorer (each stops its worker's process group) within CLOSE_TIMEOUT_S, kill
        the actors, and kill by hand the worker groups on this node of scorers that did not close
        (elsewhere a worker notices its actor's death and kills its own group)."""
        closed, errors, not_closed = gather({index: actor.close.remote() for index, actor in enumerate(self.actors)},
                                            CLOSE_TIMEOUT_S)
        pids = self.worker_pids()
        for index, actor in enumerate(self.actors):
            ray.kill(actor)  # closed or not
            if index not in closed and pids[index] is not None and _is_worker_group(pids[index]):
                kill_process_group(pids[index])
        for replica in [*(replica for replicas in self.model_actors for replica in replicas), *self.model_engines]:
            ray.kill(replica)  # a classifier holds no process of its own; an engine's vLLM dies with it
        self.model_engines = []
        self.actors, self.in_flight, self.worker_notes = [], [], []
        self.model_actors, self.model_in_flight = [[] for _ in self.model_names], [[] for _ in self.model_names]
        if errors or not_closed:
            problems = [f"scorer {index}: {error_text(error, first_line=True)}" for index, error in errors.items()]
            problems += [f"scorer {index} did not close within {CLOSE_TIMEOUT_S:g} s" for index in not_closed]
            raise RuntimeError(f"reward scorers shutdown (all were killed): {'; '.join(problems)}")

    def worker_pids(self) -> list[int | None]:
        """Each scorer's current worker pid, read from its note; None for a scorer on another node
        (its note is on that node, and there a worker notices its actor's death itself)."""
        node_id = ray.get_runtime_context().get_node_id()
        return [noted_worker(note) if node == node_id else None for node, note in self.worker_notes]

    def _all_actors(self) -> list:
        """The function scorers, then every reward model's replicas (not the judges' engines)."""
        return self.actors + [replica for replicas in self.model_actors for replica in replicas]


def start_model_replica(model: RewardModelConfig, replica: int, policy_tokenizer_path: str, placement=None):
    """(scorer actor, its judge engine or None) of replica `replica` of `model`, on the plan's slot
    (`placement`), else on a whole GPU where the cluster has GPUs."""
    options = (placement.reward_model_options(model.name, replica) if placement is not None
               else unplaced_options(model.num_cpus_per_replica, 1))
    if model.kind == "classifier":
        return RewardModelScorer.options(**results_in_object_store(options)).remote(model, policy_tokenizer_path), None
    judge = model.judge
    engine_config = RolloutConfig(max_model_len=judge.max_model_len, gpu_memory_utilization=judge.gpu_memory_utilization,
                                  enforce_eager=judge.enforce_eager, start_timeout_s=judge.start_timeout_s,
                                  num_cpus_per_engine=model.num_cpus_per_replica or 1.0)
    engine = create_engine(model.path, engine_config, dtype=model.dtype, max_restarts=1, placement_options=options)
    scorer = RewardModelScorer.options(**results_in_object_store({"num_cpus": 0})).remote(model, policy_tokenizer_path,
                                                                                         engine)
    return scorer, engine


def startup_timeout_s(model: RewardModelConfig) -> float:
    """How long a replica of `model` may take to start: a judge's engine loads its model first."""
    return STARTUP_TIMEOUT_S if model.kind == "classifier" else model.judge.start_timeout_s + STARTUP_TIMEOUT_S


def _least_loaded(in_flight: list[list[tuple[ray.ObjectRef, int]]]) -> int:
    """The index of the actor with the fewest groups in flight (`in_flight[i]`: actor i's calls not
    known done, as (first ref, number of groups)), forgetting the calls that are done."""
    for calls in in_flight:
        if calls:
            done, _ = ray.wait([ref for ref, _ in calls], num_returns=len(calls), timeout=0, fetch_local=False)
            done_set = set(done)
            calls[:] = [(ref, n) for ref, n in calls if ref not in done_set]
    loads = [sum(n for _, n in calls) for calls in in_flight]
    return loads.index(min(loads))


def _call_least_loaded(actors: list, in_flight: list[list[tuple[ray.ObjectRef, int]]], groups: list,
                       lock: threading.Lock) -> list[ray.ObjectRef]:
    """One call with `groups` on the least loaded of `actors` (`score` for one group, else
    `score_groups`): a ref per group. Choosing the actor and recording the call are one step under
    `lock`: `_least_loaded` rebuilds each actor's list of calls, and a call another thread recorded
    in between would be lost (its actor then looks idler than it is)."""
    with lock:
        index = _least_loaded(in_flight)
        actor = actors[index]
        if len(groups) == 1:
            refs = [actor.score.remote(groups[0])]
        else:
            refs = actor.score_groups.options(num_returns=len(groups)).remote(*groups)
        in_flight[index].append((refs[0], len(groups)))
    return refs
