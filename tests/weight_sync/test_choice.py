"""Which weight transport a run uses (pure): every request on every kind of cluster, on real plans,
and the per-engine NCCL rank offsets."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlactors.config import load_config
from rlactors.placement import ClusterShape, make_plan
from rlactors.weight_sync.choice import (
    RLACTORS_BACKEND,
    TRANSPORTS,
    TransportChoice,
    choose_for_plan,
    choose_transport,
    nccl_engine_init_info,
    nccl_world_size,
)

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart_cpu.yaml"


@pytest.mark.parametrize(("device_kind", "colocated", "on_sender_node", "expected"), [
    ("gpu", True, True, "ipc"),
    ("gpu", True, False, "ipc"),
    ("gpu", False, True, "nccl"),
    ("gpu", False, False, "nccl"),
    ("cpu", True, True, "shm"),
    ("cpu", False, True, "shm"),
    ("cpu", False, False, "object_store"),
    ("cpu", True, False, "object_store"),
])
def test_auto_picks_by_device_colocation_and_node(device_kind, colocated, on_sender_node, expected):
    choice = choose_transport("auto", device_kind, colocated, on_sender_node)
    assert choice.transport == expected
    assert choice.reason.startswith("auto: ")


@pytest.mark.parametrize(("requested", "device_kind", "colocated", "on_sender_node"), [
    ("nccl", "gpu", False, True),
    ("nccl", "gpu", False, False),
    ("ipc", "gpu", True, True),
    ("ipc", "gpu", True, False),
    ("shm", "gpu", False, True),
    ("shm", "cpu", True, True),
    ("shm", "cpu", False, True),
    ("object_store", "cpu", False, False),
    ("object_store", "cpu", True, True),
    ("object_store", "gpu", True, True),
    ("object_store", "gpu", False, False),
])
def test_an_explicit_transport_that_can_work_is_kept(requested, device_kind, colocated, on_sender_node):
    choice = choose_transport(requested, device_kind, colocated, on_sender_node)
    assert choice == TransportChoice(requested, f"rollout.weight_transport={requested}")


@pytest.mark.parametrize(("requested", "device_kind", "colocated", "on_sender_node", "words"), [
    ("nccl", "cpu", False, True, "needs GPUs"),
    ("nccl", "cpu", True, False, "needs GPUs"),
    ("ipc", "cpu", True, True, "needs GPUs"),
    ("ipc", "cpu", False, False, "needs GPUs"),
    ("ipc", "gpu", False, True, "colocated"),
    ("ipc", "gpu", False, False, "colocated"),
    ("nccl", "gpu", True, True, "one NCCL rank per GPU"),
    ("shm", "cpu", False, False, "trainer rank 0's node"),
    ("shm", "cpu", True, False, "trainer rank 0's node"),
    ("shm", "gpu", False, False, "trainer rank 0's node"),
    ("tcp", "cpu", False, True, "is not one of"),
    ("", "gpu", True, True, "is not one of"),
])
def test_a_transport_that_cannot_work_raises_naming_the_field(requested, device_kind, colocated, on_sender_node,
                                                               words):
    with pytest.raises(ValueError, match="rollout.weight_transport") as error:
        choose_transport(requested, device_kind, colocated, on_sender_node)
    assert words in str(error.value)


def test_every_transport_is_covered_and_auto_never_returns_auto():
    outcomes = set()
    for device_kind in ("gpu", "cpu"):
        for colocated in (True, False):
            for on_sender_node in (True, False):
                outcomes.add(choose_transport("auto", device_kind, colocated, on_sender_node).transport)
    assert outcomes == set(TRANSPORTS) - {"auto"}


def test_vllm_backend_of_each_transport():
    assert TransportChoice("nccl", "").vllm_backend == "nccl"
    assert TransportChoice("ipc", "").vllm_backend == "ipc"
    assert TransportChoice("shm", "").vllm_backend == RLACTORS_BACKEND == "rlactors"
    assert TransportChoice("object_store", "").vllm_backend == RLACTORS_BACKEND
    assert choose_transport("auto", "cpu", False, False).vllm_backend == "rlactors"
    assert choose_transport("auto", "gpu", False, False).vllm_backend == "nccl"


@pytest.mark.parametrize(("colocated", "on_sender_node", "expected"), [
    (False, True, "shm"), (False, False, "object_store"), (True, True, "shm"), (True, False, "object_store")])
def test_without_vllm_s_trainer_side_engine_auto_takes_ours(colocated, on_sender_node, expected):
    """vLLM 0.27 has a trainer-side ipc engine and no nccl one; with neither, auto falls back like on CPU."""
    choice = choose_transport("auto", "gpu", colocated, on_sender_node, vllm_trainer_backends=())
    assert choice.transport == expected
    assert "the installed vLLM has no trainer-side" in choice.reason
    assert choose_transport("auto", "gpu", True, on_sender_node, vllm_trainer_backends=("ipc",)).transport == "ipc"
    if not colocated:
        fallback = choose_transport("auto", "gpu", False, on_sender_node, vllm_trainer_backends=("ipc",))
        assert fallback.transport == expected and "no trainer-side nccl engine" in fallback.reason


@pytest.mark.parametrize(("requested", "colocated"), [("nccl", False), ("ipc", True)])
def test_a_transport_the_installed_vllm_lacks_raises_naming_the_field(requested, colocated):
    with pytest.raises(ValueError, match=f"rollout.weight_transport: {requested} needs vLLM's trainer-side "
                                         f"{requested} engine, which the installed vLLM lacks"):
        choose_transport(requested, "gpu", colocated, True, vllm_trainer_backends=())


def test_the_installed_vllm_has_the_trainer_side_engines_auto_picks_on_gpus():
    """What `choose_for_plan` reads on GPU plans: both engines on vLLM >= 0.32, ipc only on 0.27."""
    import vllm

    from rlactors.runtime.vllm_features import trainer_backends

    assert "ipc" in trainer_backends()
    has_nccl = {"0.27.1": False, "0.32.0": True}.get(vllm.__version__)  # the two versions the suite runs on
    assert has_nccl is None or ("nccl" in trainer_backends()) == has_nccl


def quickstart(*overrides):
    return load_config(QUICKSTART, list(overrides))


def test_async_plan_on_two_cpu_nodes_puts_the_engine_elsewhere_and_gets_object_store():
    plan = make_plan(quickstart("pipeline.mode=async"), ClusterShape.uniform(2, 0, num_cpus_per_node=1.0))
    assert plan.feasible, plan.reason
    assert plan.device_kind == "cpu"
    sender_node = plan.bundle_of("actor", 0)[0].node
    engine_node = plan.engine_bundles(0)[0].node
    assert sender_node != engine_node
    assert choose_for_plan("auto", plan, num_engines=1, colocated=False).transport == "object_store"
    assert choose_for_plan("object_store", plan, num_engines=1, colocated=False).transport == "object_store"
    with pytest.raises(ValueError, match="rollout.weight_transport: shm needs every engine"):
        choose_for_plan("shm", plan, num_engines=1, colocated=False)
    with pytest.raises(ValueError, match="rollout.weight_transport: nccl needs GPUs"):
        choose_for_plan("nccl", plan, num_engines=1, colocated=False)


@pytest.mark.parametrize("mode", ["async", "colocated"])
def test_plans_on_one_cpu_node_get_shm(mode):
    plan = make_plan(quickstart(f"pipeline.mode={mode}"), ClusterShape.uniform(1, 0, num_cpus_per_node=4.0))
    assert plan.feasible, plan.reason
    assert {bundle.node for bundle in plan.bundles} == {0}
    assert choose_for_plan("auto", plan, num_engines=1, colocated=mode == "colocated").transport == "shm"
    assert choose_for_plan("shm", plan, num_engines=1, colocated=mode == "colocated").transport == "shm"


def test_colocated_plan_on_two_cpu_nodes_keeps_the_engine_with_the_sender():
    plan = make_plan(quickstart("pipeline.mode=colocated"), ClusterShape.uniform(2, 0, num_cpus_per_node=2.0))
    assert plan.feasible, plan.reason
    assert plan.bundle_of("actor", 0)[0].node == plan.engine_bundles(0)[0].node
    assert choose_for_plan("auto", plan, num_engines=1, colocated=True).transport == "shm"


def test_every_engine_counts_not_just_one():
    """Three engines on two nodes of 2 CPUs: engines 0 and 1 fill node 0, engine 2 shares node 1
    with the sender. One engine with the sender does not make shm possible for the others."""
    config = quickstart("pipeline.mode=async", "rollout.num_engines=3")
    plan = make_plan(config, ClusterShape.uniform(2, 0, num_cpus_per_node=2.0))
    assert plan.feasible, plan.reason
    sender_node = plan.bundle_of("actor", 0)[0].node
    engine_nodes = [plan.engine_bundles(engine)[0].node for engine in range(3)]
    assert engine_nodes == [0, 0, 1] and sender_node == 1
    assert choose_for_plan("auto", plan, num_engines=3, colocated=False).transport == "object_store"
    with pytest.raises(ValueError, match="shm needs every engine"):
        choose_for_plan("shm", plan, num_engines=3, colocated=False)


def test_gpu_plans_get_nccl_apart_and_ipc_colocated():
    """nccl where the installed vLLM has its trainer-side engine (0.32), else object_store: the
    engines are on another node than the sender."""
    from rlactors.runtime.vllm_features import trainer_backends

    separate = make_plan(load_config(None, ["pipeline.mode=async", "rollout.num_engines=2", "trainer.num_workers=2"]),
                         ClusterShape.uniform(2, 2))
    assert separate.feasible and separate.device_kind == "gpu"
    expected = "nccl" if "nccl" in trainer_backends() else "object_store"
    assert choose_for_plan("auto", separate, num_engines=2, colocated=False).transport == expected
    colocated = make_plan(load_config(None, ["rollout.num_engines=2", "trainer.num_workers=2"]), ClusterShape.uniform(1, 2))
    assert colocated.feasible and colocated.device_kind == "gpu"
    assert choose_for_plan("auto", colocated, num_engines=2, colocated=True).transport == "ipc"


def test_planning_without_vllm_installed_assumes_the_newest_supported(monkeypatch):
    """A laptop without vLLM plans for a cluster: nccl, as vLLM 0.32 would; the run decides on the cluster."""
    import rlactors.runtime.vllm_features

    monkeypatch.setattr(rlactors.runtime.vllm_features, "trainer_backends", lambda: None)
    separate = make_plan(load_config(None, ["pipeline.mode=async", "rollout.num_engines=2", "trainer.num_workers=2"]),
                         ClusterShape.uniform(2, 2))
    assert choose_for_plan("auto", separate, num_engines=2, colocated=False).transport == "nccl"
    monkeypatch.setattr(rlactors.runtime.vllm_features, "trainer_backends", lambda: ())  # installed, with none of its own
    assert choose_for_plan("auto", separate, num_engines=2, colocated=False).transport == "object_store"


def test_nccl_rank_offsets_follow_the_workers_of_the_engines_before():
    info = {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 7}
    offsets = [nccl_engine_init_info(info, position, workers_per_engine=2)["rank_offset"] for position in range(3)]
    assert offsets == [1, 3, 5]
    assert [nccl_engine_init_info(info, position, 1)["rank_offset"] for position in range(4)] == [1, 2, 3, 4]
    shifted = nccl_engine_init_info(info, 2, 2)
    assert {k: v for k, v in shifted.items() if k != "rank_offset"} == {k: v for k, v in info.items()
                                                                        if k != "rank_offset"}
    assert info["rank_offset"] == 1  # the shared info is left as it was
    # Each engine's workers take the ranks after the sender's 0, without overlap, up to the world size.
    world = nccl_world_size(num_engines=3, workers_per_engine=2)
    assert world == 7
    ranks = [offset + worker for offset in offsets for worker in range(2)]
    assert ranks == list(range(1, world))
    assert nccl_world_size(1, 1) == 2
    assert nccl_world_size(4, 8) == 33
