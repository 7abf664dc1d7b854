"""A `ResourcePlan` realised on a Ray cluster: the live cluster's shape, placement groups, and the
Ray options of every actor.

    plan = make_plan(config, cluster_shape_from_ray())
    placement = Placement.reserve(plan, timeout_s=60)      # PlacementError naming what is missing
    ray.remote(TrainerWorker).options(**placement.trainer_options("actor", rank))
    RolloutEngine.options(**placement.engine_options(engine))
    placement.release()

One placement group per (pool, node), its bundles pinned to the plan's node by Ray's node-id label,
so the plan's layout is the cluster's: colocated roles of a device sit in one bundle (one GPU, shared
through fractional requests), an engine's tensor-parallel ranks in one group on one node.

vLLM with tensor_parallel_size > 1 starts its own Ray workers: the engine actor (in its tp-rank-0
bundle, holding CPUs only) passes the placement group on to them (`placement_group_capture_child_tasks`),
and `VLLM_RAY_BUNDLE_INDICES` / `VLLM_RAY_PER_WORKER_GPUS` tell vLLM's Ray executor which bundles and
what share of each GPU its workers take (vLLM 0.32 `v1/executor/ray_executor.py`).
"""

from __future__ import annotations

import os
import uuid
from collections import defaultdict
from pathlib import Path

import ray
from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from rlactors.placement.plan import (
    ROLLOUT,
    ClusterShape,
    Node,
    PlanError,
    ResourcePlan,
    make_plan,
    reward_model_role,
)
from rlactors.runtime.calls import error_text, gather


def cluster_shape_from_ray() -> ClusterShape:
    """The live nodes of the connected Ray cluster (ordered by node id, so plans are repeatable)."""
    nodes = []
    for node in sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeID"]):
        resources = node["Resources"]
        if resources.get("CPU", 0) or resources.get("GPU", 0):
            nodes.append(Node(node["NodeID"], int(resources.get("GPU", 0)), float(resources.get("CPU", 0))))
    return ClusterShape(tuple(nodes))


def local_cluster_shape() -> ClusterShape:
    """This machine as a one-node cluster: its visible GPUs and the CPUs this process may use."""
    from rlactors.runtime.device import detect_platform

    num_gpus = 0
    if detect_platform() != "cpu":
        import torch

        num_gpus = torch.cuda.device_count()
    return ClusterShape((Node("local", num_gpus, float(len(os.sched_getaffinity(0)))),))


def plan_for_cluster(config) -> ResourcePlan:
    """The plan of `config` on the connected cluster; PlanError with the reason if it cannot fit."""
    plan = make_plan(config, cluster_shape_from_ray())
    if not plan.feasible:
        raise PlanError(f"the run cannot be placed: {plan.reason} (see `python -m rlactors plan`)")
    return plan


class Placement:
    """The placement groups of one plan; `release()` frees them (actors in them should be gone)."""

    def __init__(self, plan: ResourcePlan, groups: dict[tuple[str, int], tuple[object, list[int]]]):
        self.plan = plan
        self.groups = groups  # (pool, node) -> (placement group, plan bundle indices in group order)
        self._where: dict[int, tuple[object, int]] = {}  # plan bundle index -> (group, index in group)
        for group, indices in groups.values():
            for local_index, bundle_index in enumerate(indices):
                self._where[bundle_index] = (group, local_index)

    @classmethod
    def reserve(cls, plan: ResourcePlan, timeout_s: float) -> Placement:
        """Create and wait for the plan's placement groups; PlanError within `timeout_s` naming the
        bundles that could not be placed and what their node has free."""
        if not plan.feasible:
            raise PlanError(f"the run cannot be placed: {plan.reason}")
        members: dict[tuple[str, int], list[int]] = defaultdict(list)
        for bundle in plan.bundles:
            members[(bundle.pool, bundle.node)].append(bundle.index)
        groups = {}
        for (pool, node), indices in members.items():
            node_id = plan.cluster.nodes[node].node_id
            group = placement_group([plan.bundles[i].resources(plan.device_kind) for i in indices], strategy="PACK",
                                    bundle_label_selector=[{NODE_ID_LABEL_KEY: node_id}] * len(indices),
                                    name=f"rlactors-{pool}-{node}-{os.getpid()}")
            groups[(pool, node)] = (group, indices)
        placement = cls(plan, groups)
        _, _, pending = gather({key: group.ready() for key, (group, _) in groups.items()}, timeout_s)
        if pending:
            message = placement._missing(pending, timeout_s)
            placement.release()
            raise PlanError(message)
        return placement

    def _missing(self, keys: list[tuple[str, int]], timeout_s: float) -> str:
        from ray._private.state import available_resources_per_node

        available = available_resources_per_node()
        parts = []
        for pool, node in keys:
            node_id = self.plan.cluster.nodes[node].node_id
            needed: dict[str, float] = defaultdict(float)
            for index in self.groups[(pool, node)][1]:
                for name, amount in self.plan.bundles[index].resources(self.plan.device_kind).items():
                    needed[name] += amount
            free = {name: available.get(node_id, {}).get(name, 0.0) for name in needed}
            parts.append(f"{pool} devices on node {node_id[:12]} need {_resources(needed)}, it has {_resources(free)} free")
        return (f"placement groups not placed within pipeline.placement_timeout_s={timeout_s:g} s: " + "; ".join(parts)
                + " (other jobs or actors may hold them; `ray status` shows what is in use)")

    def _strategy(self, bundle_index: int, capture_child_tasks: bool = False) -> PlacementGroupSchedulingStrategy:
        group, local_index = self._where[bundle_index]
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=local_index,
                                                placement_group_capture_child_tasks=capture_child_tasks)

    def trainer_options(self, role: str, rank: int) -> dict:
        """Ray options of trainer rank `rank` of `role` ("actor", "reference" or "critic")."""
        return self._slot_options(role, rank)

    def reward_model_options(self, name: str, replica: int) -> dict:
        """Ray options of replica `replica` of reward model `name` (`reward.models`)."""
        return self._slot_options(reward_model_role(name), replica)

    def _slot_options(self, role: str, rank: int) -> dict:
        bundle, slot = self.plan.bundle_of(role, rank)
        return {"num_cpus": slot.num_cpus, "num_gpus": slot.num_gpus, "scheduling_strategy": self._strategy(bundle.index)}

    def engine_options(self, engine: int) -> dict:
        """Ray options of rollout engine `engine`. With tensor parallelism on GPUs the actor holds
        CPUs only and vLLM's Ray workers take the GPU shares of the engine's bundles."""
        bundles = self.plan.engine_bundles(engine)
        _, slot = self.plan.bundle_of(ROLLOUT, engine)
        if len(bundles) == 1:
            return {"num_cpus": slot.num_cpus, "num_gpus": slot.num_gpus, "scheduling_strategy": self._strategy(bundles[0].index)}
        env = {"VLLM_RAY_PER_WORKER_GPUS": str(slot.num_gpus),
               "VLLM_RAY_BUNDLE_INDICES": ",".join(str(self._where[b.index][1]) for b in bundles)}
        return {"num_cpus": slot.num_cpus, "num_gpus": 0,
                "scheduling_strategy": self._strategy(bundles[0].index, capture_child_tasks=True),
                "runtime_env": {"env_vars": env}}

    def near(self, role: str, rank: int = 0) -> dict:
        """Ray options putting an actor outside the bundles on the node of `role` rank `rank`, which
        it trades data with (the replay buffer and the batch builder sit with actor rank 0, which
        reads every training batch). Hard affinity: Ray 2.60 ignores a soft one for actors that
        ask for no CPU, and if that node goes, the trainer rank on it goes with it anyway."""
        bundle, _ = self.plan.bundle_of(role, rank)
        node_id = self.plan.cluster.nodes[bundle.node].node_id
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}

    def release(self) -> None:
        for group, _ in self.groups.values():
            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001 - the cluster may be going away with the run
                pass
        self.groups, self._where = {}, {}


def reserve_for(config, timeout_s: float | None = None) -> Placement:
    """Plan `config` on the connected cluster and reserve it (the one call `build_run` makes)."""
    plan = plan_for_cluster(config)
    return Placement.reserve(plan, config.pipeline.placement_timeout_s if timeout_s is None else timeout_s)


def _resources(resources: dict[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in sorted(resources.items()))


def unplaced_options(num_cpus: float, num_devices: int) -> dict:
    """Ray options of an actor started outside any plan (a notebook, a test): `num_devices` whole
    GPUs when the connected cluster has GPUs, none otherwise. Runs place every actor by their plan."""
    has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    return {"num_cpus": num_cpus, "num_gpus": num_devices if has_gpus else 0}


@ray.remote(num_cpus=0)
def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def check_visible_everywhere(directory: Path, plan: ResourcePlan, timeout_s: float = 60.0) -> None:
    """Fail unless every other node of the plan reads the file the driver writes in `directory`.

    Trainer ranks write checkpoint shards under the run's output_dir from their own nodes; a path
    that is local to each node (a relative one under `ray job submit --working-dir`, /tmp, ...)
    would scatter a checkpoint over copies nobody reads together."""
    driver_node = ray.get_runtime_context().get_node_id()
    node_ids = sorted({plan.cluster.nodes[b.node].node_id for b in plan.bundles} - {driver_node})
    if not node_ids:
        return
    marker = directory / f".visible-{uuid.uuid4().hex}"
    marker.write_text(marker.name)
    try:
        read, errors, pending = gather({node_id: _read_text.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            node_id, soft=False)).remote(str(marker)) for node_id in node_ids}, timeout_s)
        if pending or errors:
            raise PlanError(f"could not check pipeline.output_dir={directory} from nodes "
                            f"{[node_id[:12] for node_id in pending]} within {timeout_s:g} s" + "".join(
                                f"; node {node_id[:12]}: {error_text(error)}" for node_id, error in errors.items()))
        blind = [node_id[:12] for node_id, text in read.items() if text != marker.name]
        if blind:
            raise PlanError(f"pipeline.output_dir={directory} is not visible from nodes {blind}: on a multi-node "
                            f"cluster it must be a path on a filesystem every node shares (e.g. NFS), so that "
                            f"checkpoint shards written by every rank land in one place")
    finally:
        marker.unlink(missing_ok=True)
