"""The plan realised on a simulated multi-node cluster (Ray's `cluster_utils.Cluster`): probe actors
started with exactly the options each role gets land on the plan's node and device.

Ray schedules declared GPUs without touching CUDA, so `ray.get_gpu_ids()` tells which device a role
would use. vLLM's tensor-parallel workers are probed as vLLM's Ray executor starts them: from inside
the engine actor, in the bundles `VLLM_RAY_BUNDLE_INDICES` names of the engine's placement group,
each asking for `VLLM_RAY_PER_WORKER_GPUS` of a GPU and no CPU.
"""

import os
from pathlib import Path

import pytest
import ray
from conftest import another_ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlactors.config import load_config
from rlactors.placement import PlanError
from rlactors.placement.cluster import Placement, cluster_shape_from_ray, plan_for_cluster

GPUS_PER_NODE = 2


class ProbeImpl:
    def where(self) -> dict:
        return {"node_id": ray.get_runtime_context().get_node_id(), "gpu_ids": sorted(map(str, ray.get_gpu_ids())),
                "vllm_env": {k: os.environ.get(k) for k in ("VLLM_RAY_PER_WORKER_GPUS", "VLLM_RAY_BUNDLE_INDICES")}}

    def start_tensor_parallel_workers(self) -> list[dict]:
        group = ray.util.get_current_placement_group()
        assert group is not None, "the engine actor does not pass its placement group on"
        share = float(os.environ["VLLM_RAY_PER_WORKER_GPUS"])
        workers = [ray.remote(ProbeImpl).options(num_cpus=0, num_gpus=share, scheduling_strategy=(
            PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=int(index))))
            .remote() for index in os.environ["VLLM_RAY_BUNDLE_INDICES"].split(",")]
        return ray.get([worker.where.remote() for worker in workers], timeout=120)


Probe = ray.remote(ProbeImpl)


@pytest.fixture(scope="module")
def gpu_cluster():
    """A CPU-only head (as under `ray job submit`) and two nodes of 2 declared GPUs and 8 CPUs."""
    # The probes' class lives in this test module (which imports conftest): both folders go on the
    # workers' path.
    here = Path(__file__).parent
    nodes = [{"num_cpus": 1, "num_gpus": 0}] + [{"num_cpus": 8, "num_gpus": GPUS_PER_NODE}] * 2
    with another_ray(nodes, runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(here), str(here.parent)])}}) \
            as cluster:
        yield cluster


def probe_plan(config) -> tuple[object, dict[str, dict]]:
    """Start one probe per role (and per tensor-parallel worker) with the plan's options; where each ran."""
    plan = plan_for_cluster(config)
    placement = Placement.reserve(plan, timeout_s=60)
    try:
        roles = {slot.name: slot for bundle in plan.bundles for slot in bundle.roles}
        probes = {name: Probe.options(**placement.trainer_options(slot.role, slot.rank)).remote()
                  for name, slot in roles.items() if slot.role != "rollout"}
        engines = {slot.rank: Probe.options(**placement.engine_options(slot.rank)).remote()
                   for slot in roles.values() if slot.role == "rollout" and slot.tp_rank == 0}
        probes["near:actor"] = Probe.options(num_cpus=0, **placement.near("actor")).remote()  # the buffer's place
        seen = dict(zip(probes, ray.get([p.where.remote() for p in probes.values()], timeout=120), strict=True))
        for engine, probe in engines.items():
            seen[f"engine:{engine}"] = front_end = ray.get(probe.where.remote(), timeout=120)
            if front_end["vllm_env"]["VLLM_RAY_BUNDLE_INDICES"]:
                workers = ray.get(probe.start_tensor_parallel_workers.remote(), timeout=120)
            else:
                workers = [front_end]  # tensor_parallel_size 1: the engine actor holds the GPU itself
            for tp_rank, where in enumerate(workers):
                seen[f"rollout:{engine}/tp{tp_rank}"] = where
        return plan, seen
    finally:
        placement.release()


def test_colocated_roles_share_each_device_of_the_plan(gpu_cluster):
    config = load_config(None, ["rollout.num_engines=2", "rollout.tensor_parallel_size=2", "trainer.num_workers=4",
                                "algorithm.use_kl_loss=true"])
    plan, seen = probe_plan(config)
    assert plan.device_kind == "gpu" and plan.num_devices == 4
    assert {name for b in plan.bundles for name in (s.name for s in b.roles)} <= set(seen)
    devices = set()
    for bundle in plan.bundles:
        node_id = plan.cluster.nodes[bundle.node].node_id
        places = {(seen[slot.name]["node_id"], tuple(seen[slot.name]["gpu_ids"])) for slot in bundle.roles}
        assert len(places) == 1, f"roles of device {bundle.index} run apart: {places}"
        (node, gpu_ids), = places
        assert node == node_id and len(gpu_ids) == 1
        devices.add((node, gpu_ids))
    assert len(devices) == 4  # four distinct devices
    for engine in range(2):
        assert seen[f"engine:{engine}"]["gpu_ids"] == []  # vLLM's workers hold the GPUs, not the front end
        assert seen[f"rollout:{engine}/tp0"]["node_id"] == seen[f"rollout:{engine}/tp1"]["node_id"]
    assert seen["actor:0"]["node_id"] != seen["actor:2"]["node_id"]  # two devices per node: ranks 0-1, 2-3


def test_async_pools_are_disjoint_and_on_nodes_of_their_own(gpu_cluster):
    config = load_config(None, ["pipeline.mode=async", "rollout.num_engines=2", "trainer.num_workers=2",
                                "algorithm.advantage=gae"])
    plan, seen = probe_plan(config)
    rollout = {(seen[f"rollout:{e}/tp0"]["node_id"], *seen[f"rollout:{e}/tp0"]["gpu_ids"]) for e in range(2)}
    training = {(seen[f"{role}:{rank}"]["node_id"], *seen[f"{role}:{rank}"]["gpu_ids"])
                for role in ("actor", "critic") for rank in range(2)}
    assert len(rollout) == 2 and len(training) == 2  # actor and critic rank r share a device
    assert not rollout & training
    assert len({node for node, _ in rollout}) == 1 and len({node for node, _ in training}) == 1
    assert {node for node, _ in rollout} != {node for node, _ in training}
    assert seen["actor:0"]["gpu_ids"] == seen["critic:0"]["gpu_ids"]
    assert seen["near:actor"]["node_id"] == seen["actor:0"]["node_id"]


def test_a_plan_larger_than_the_cluster_fails_before_any_actor(gpu_cluster):
    config = load_config(None, ["rollout.num_engines=2", "rollout.tensor_parallel_size=4"])
    with pytest.raises(PlanError, match="tensor_parallel_size=4 needs 4 GPUs on one node; the largest node has 2"):
        plan_for_cluster(config)
    assert cluster_shape_from_ray().num_gpus == 2 * GPUS_PER_NODE


def test_unplaceable_groups_fail_within_the_timeout_naming_what_is_missing(gpu_cluster):
    plan = plan_for_cluster(load_config(None, ["pipeline.mode=async", "rollout.num_engines=2", "trainer.num_workers=2"]))
    rollout_node = plan.cluster.nodes[plan.bundles[0].node].node_id
    blocker = placement_group([{"GPU": 1}], bundle_label_selector=[{"ray.io/node-id": rollout_node}])
    ray.get(blocker.ready(), timeout=60)
    try:
        with pytest.raises(PlanError) as error:
            Placement.reserve(plan, timeout_s=3)
        message = str(error.value)
        assert "pipeline.placement_timeout_s=3 s" in message
        assert f"rollout devices on node {rollout_node[:12]} need 2 CPU, 2 GPU, it has 8 CPU, 1 GPU free" in message
        assert "training" not in message  # the training pool's node had room
    finally:
        remove_placement_group(blocker)
    Placement.reserve(plan, timeout_s=60).release()  # placeable again once the blocker is gone


def test_plan_command_reads_the_live_cluster(gpu_cluster):
    import json
    import subprocess
    import sys

    config = Path(__file__).resolve().parents[2] / "examples" / "gsm8k_grpo_qwen3_8b.yaml"
    result = subprocess.run([sys.executable, "-m", "rlactors", "plan", str(config), "--json"], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "RAY_ADDRESS": gpu_cluster.address})
    report = json.loads(result.stdout)
    assert result.returncode == 2 and report["feasible"] is False
    assert report["reason"] == "needs 8 GPUs in 4 nodes of 2; the cluster has 4 GPUs (2 nodes of 2)"
