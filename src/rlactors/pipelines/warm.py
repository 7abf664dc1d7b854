"""Rollout engines and trainer groups kept started between the runs of one driver process: a
notebook's sweep, a test session.

    warm = WarmActors()
    run_pipeline(config, warm=warm)         # starts its engines and trainers, and keeps them at the end
    run_pipeline(other_config, warm=warm)   # the same engine settings and plan: takes them, no vLLM start
    warm.close()                            # stops what is kept

Starting vLLM is most of a short run's cost (~25 s on 2 CPU cores; minutes for a large model on
GPUs), and a trainer group's processes and process group much of the rest (~5 s a group on 2 CPU
cores; NCCL set-up on GPUs). A run takes the kept engines only if it would have started them
exactly so: the same model folder, engine settings, dtype and weight transport, and the same
resource plan on the same cluster (`engine_key`); otherwise they are stopped and the run starts its
own. The rollout settings an engine serves by rather than starts with (sampling, episodes,
interruptions, timeouts: `RolloutConfig.PER_RUN`) may differ. The run then begins as after a
resume: the engines are told it is a new run, with its settings (policy_version 0, empty phase
logs, `RolloutEngine.new_run`), and get its weights by the run's own first weight sync before they
generate; until then they refuse to.

Trainer groups are kept with the engines (they live in the same placement groups), one per role.
A run takes a kept group of its role if the group's processes were started as the run would start
them: the same number of ranks, CPUs per rank, cores and collective timeout (`trainer_key`). It
then begins on it as on a new group (`TrainerGroup.start_run`: the model loaded from the run's model
folder, a fresh optimizer and schedule, the RNG seeded from the run's seed); what a run leaves in
a rank's memory does not reach the next. Groups that do not match are stopped before the run
starts its own in their place.

A run gives its engines back (`keep`) unless one of its replicas failed (a replica Ray restarted
has spent restarts the next run would count on), also a run that stopped with an error elsewhere
(a reward function, the trainer): the next run in a notebook is often the same one, fixed. They
are brought to rest first: whatever they still generate aborted, the weight-transfer engine of the
trainer that is gone left, asleep; engines that cannot be (a weight update left open) are stopped
with the run. Its trainer groups are given back only by a run that finished (one that stopped with
an error may have left a rank inside a collective) and only with its engines. Kept actors hold
their placement groups (their devices). One set is kept at a time; a run that cannot take it stops
it first, so the devices are free for its own.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

import ray

from rlactors.config import Config, TrainerConfig
from rlactors.pipelines.teardown import Part, run_parts, stop_all


def engine_key(config: Config, model_path: str, plan, weight_backend: str) -> tuple:
    """What must match for a run to take kept engines: what they were started with and where. The
    rollout settings a run may change on started engines (`RolloutConfig.PER_RUN`: sampling,
    episodes, timeouts) are not part of it; `RolloutRouter.new_run` hands them over."""
    return (str(model_path), json.dumps(config.rollout.start_settings(), sort_keys=True), config.model.dtype,
            weight_backend, plan)


def trainer_key(role: str, trainer: TrainerConfig) -> tuple:
    """What must match for a run to take a kept trainer group: what its processes were started with
    (`TrainerWorker.__init__` and `setup`). The rest of the trainer settings each run brings anew."""
    return (role, trainer.num_workers, trainer.num_cpus_per_worker, repr(trainer.cpu_cores), trainer.collective_timeout_s)


def cluster_address() -> str | None:
    return ray.get_runtime_context().gcs_address if ray.is_initialized() else None


@dataclass
class Kept:
    key: tuple
    placement: object  # rlactors.placement.cluster.Placement
    engines: list  # RolloutEngine actor handles, replica order
    cluster: str | None  # the Ray cluster they live on (a Ray restarted since has ended them)
    trainers: dict = field(default_factory=dict)  # trainer_key -> TrainerGroup, in the same placement


class WarmActors:
    def __init__(self):
        self.kept: Kept | None = None
        self.num_taken = 0  # runs that took kept engines instead of starting their own
        self.num_trainers_taken = 0  # trainer groups runs took instead of starting their own

    def take(self, key: tuple) -> Kept | None:
        """The kept engines if they match `key` (then no longer kept: the run owns them); else
        None, and whatever was kept is stopped first."""
        kept, self.kept = self.kept, None
        if kept is None:
            return None
        if kept.cluster == cluster_address() and kept.key == key:
            self.num_taken += 1
            return kept
        self._stop(kept)
        return None

    def take_trainers(self, kept: Kept, keys: list[tuple]) -> dict:
        """The groups of `kept` whose `trainer_key` is among `keys`, by key; the others are stopped
        (their bundles are the run's to start its own in)."""
        taken = {key: kept.trainers.pop(key) for key in keys if key in kept.trainers}
        left, kept.trainers = list(kept.trainers.values()), {}
        if left:
            stop_all(run_parts(left, None, None, None, None))
        self.num_trainers_taken += len(taken)
        return taken

    def keep(self, key: tuple, placement, router, trainers: dict | None = None) -> bool:
        """Keep a finished run's engines and placement for the next run, at rest, and with them
        `trainers` (trainer_key -> TrainerGroup; the caller passes only a finished run's healthy
        groups); False (nothing kept, the caller stops them all) if a replica failed or the engines
        cannot be brought to rest."""
        if any(h["state"] != "healthy" or h["num_failures"] for h in router.health()):
            return False
        try:
            router.abort()
            router.stop_weight_transfer()
            router.sleep()
        except Exception as error:  # noqa: BLE001 - not kept; the run's teardown stops them
            print(f"rollout engines not kept for the next run: {type(error).__name__}: {error}", file=sys.stderr)
            return False
        self.close()
        self.kept = Kept(key, placement, list(router.engines), cluster_address(), dict(trainers or {}))
        return True

    def close(self) -> None:
        """Stop the kept engines and trainer groups and release their placement groups."""
        kept, self.kept = self.kept, None
        if kept is not None:
            self._stop(kept)

    @staticmethod
    def _stop(kept: Kept) -> None:
        if kept.cluster != cluster_address():
            return  # that cluster is gone, and its engines and placement groups with it
        stop_all(run_parts(kept.trainers.values(), None, None, None, None)
                 + [Part(f"kept rollout engine {i}", actors=[engine]) for i, engine in enumerate(kept.engines)],
                 kept.placement)
