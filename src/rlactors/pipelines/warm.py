"""Rollout engines kept started between the runs of one driver process: a notebook's sweep, a
test session.

    warm = WarmEngines()
    run_pipeline(config, warm=warm)         # starts its engines, and keeps them at the end
    run_pipeline(other_config, warm=warm)   # the same engine settings and plan: takes them, no vLLM start
    warm.close()                            # stops what is kept

Starting vLLM is most of a short run's cost (~25 s on 2 CPU cores; minutes for a large model on
GPUs). A run takes the kept engines only if it would have started them exactly so: the same model
folder, rollout settings, dtype and weight transport, and the same resource plan on the same
cluster (`engine_key`); otherwise they are stopped and the run starts its own. The run then begins
as after a resume: the engines are told it is a new run (policy_version 0, empty phase logs,
`RolloutEngine.new_run`) and get its weights by the run's own first weight sync before they
generate; until then they refuse to.

A run gives its engines back (`keep`) unless one of its replicas failed (a replica Ray restarted
has spent restarts the next run would count on), also a run that stopped with an error elsewhere
(a reward function, the trainer): the next run in a notebook is often the same one, fixed. They
are brought to rest first: whatever they still generate aborted, the weight-transfer engine of the
trainer that is gone left, asleep; engines that cannot be (a weight update left open) are stopped
with the run. Kept engines hold their placement groups (their devices). One set is kept at a time;
a run that cannot take it stops it first, so the devices are free for its own.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import ray

from rlactors.config import Config
from rlactors.pipelines.teardown import Part, stop_all


def engine_key(config: Config, model_path: str, plan, weight_backend: str) -> tuple:
    """What must match for a run to take kept engines: what they were started with and where."""
    return (str(model_path), config.rollout.model_dump_json(), config.model.dtype, weight_backend, plan)


def cluster_address() -> str | None:
    return ray.get_runtime_context().gcs_address if ray.is_initialized() else None


@dataclass
class Kept:
    key: tuple
    placement: object  # rlactors.placement.cluster.Placement
    engines: list  # RolloutEngine actor handles, replica order
    cluster: str | None  # the Ray cluster they live on (a Ray restarted since has ended them)


class WarmEngines:
    def __init__(self):
        self.kept: Kept | None = None
        self.num_taken = 0  # runs that took kept engines instead of starting their own

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

    def keep(self, key: tuple, placement, router) -> bool:
        """Keep a finished run's engines and placement for the next run, at rest; False (nothing
        kept, the caller stops them) if a replica failed or they cannot be brought to rest."""
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
        self.kept = Kept(key, placement, list(router.engines), cluster_address())
        return True

    def close(self) -> None:
        """Stop the kept engines and release their placement groups."""
        kept, self.kept = self.kept, None
        if kept is not None:
            self._stop(kept)

    @staticmethod
    def _stop(kept: Kept) -> None:
        if kept.cluster != cluster_address():
            return  # that cluster is gone, and its engines and placement groups with it
        stop_all([Part(f"kept rollout engine {i}", actors=[engine]) for i, engine in enumerate(kept.engines)],
                 kept.placement)
