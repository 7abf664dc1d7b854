"""Real CPU runs of the quickstart on a simulated two-node cluster (Ray's `cluster_utils.Cluster`),
colocated and async, with a relative `pipeline.output_dir`: every node writes into the one absolute
directory the driver resolved, and the plan puts roles on different nodes."""

import json
from pathlib import Path

import pytest
from conftest import another_ray

from rlactors.config import load_config
from rlactors.pipelines import run_pipeline
from rlactors.placement.cluster import plan_for_cluster

pytestmark = pytest.mark.vllm
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def two_nodes():
    """Two nodes of 2 declared CPUs each (the head one of them), sharing this machine's filesystem."""
    with another_ray([{"num_cpus": 2, "object_store_memory": 1 << 30}] * 2) as cluster:
        yield cluster


def quickstart(tiny_model_dir, output_dir: str, *overrides):
    return load_config(EXAMPLES / "quickstart_cpu.yaml", [
        f"model.path={tiny_model_dir}", "data.num_train_rows=64", "data.num_val_rows=4",
        "rollout.sampling.num_samples_per_prompt=4", "rollout.sampling.seed=1", "pipeline.num_steps=2",
        "pipeline.batch_size_prompts=4", "pipeline.val_every_steps=0", "pipeline.checkpoint_every_steps=2",
        "pipeline.resume=never", f"pipeline.output_dir={output_dir}", *overrides])


def check_outputs(output_dir: Path, num_ranks: int):
    steps = [json.loads(line)["step"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]
    actor = output_dir / "checkpoints" / "step_00000002" / "actor" / "step_00000002"
    assert sorted(p.name for p in actor.glob("rank_*.pt")) == [f"rank_{r}.pt" for r in range(num_ranks)]
    assert len(list(actor.glob("*.distcp"))) == num_ranks  # every rank's shard, in one place
    assert (output_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"


@pytest.mark.slow  # plans across nodes: tests/placement; the async run itself: tests/pipelines/test_pipelines.py
def test_async_run_with_engine_and_trainer_on_different_nodes(two_nodes, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = quickstart(tiny_model_dir, "async-run", "pipeline.mode=async")
    plan = plan_for_cluster(config)
    pools = {bundle.pool: bundle.node for bundle in plan.bundles}
    assert pools["rollout"] != pools["training"]
    history = run_pipeline(config)
    assert [h["step"] for h in history] == [0, 1, 2]
    check_outputs(tmp_path / "async-run", num_ranks=1)


@pytest.mark.extended  # placing ranks on both nodes: tests/placement; a run across nodes: the async one above
def test_colocated_run_with_trainer_ranks_on_both_nodes(two_nodes, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = quickstart(tiny_model_dir, "colocated-run", "trainer.num_workers=2")
    plan = plan_for_cluster(config)
    assert {plan.bundle_of("actor", 0)[0].node, plan.bundle_of("actor", 1)[0].node} == {0, 1}
    assert plan.bundle_of("rollout", 0)[0] is plan.bundle_of("actor", 0)[0]  # colocated: one bundle
    history = run_pipeline(config)
    assert [h["step"] for h in history] == [0, 1, 2]
    check_outputs(tmp_path / "colocated-run", num_ranks=2)
