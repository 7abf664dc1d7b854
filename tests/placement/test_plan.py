"""The resource plan (pure) and the `plan` command on the shipped examples and hand-made shapes."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlactors.config import load_config
from rlactors.placement import ClusterShape, Node, make_plan
from rlactors.placement.memory import count_parameters, estimate_memory, memory_verdict
from rlactors.placement.report import format_report, plan_report

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GSM8K = EXAMPLES / "gsm8k_grpo_qwen3_8b.yaml"
DAPO_ASYNC = EXAMPLES / "math_dapo_qwen2.5_math_7b_async.yaml"
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "tie_word_embeddings": False, "max_position_embeddings": 40960,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False, "max_position_embeddings": 40960,
}
MOE_ASYNC = EXAMPLES / "math_grpo_qwen3_30b_a3b_async.yaml"
LORA = EXAMPLES / "gsm8k_grpo_qwen3_8b_lora.yaml"
REWARD_MODEL = EXAMPLES / "chat_grpo_qwen3_8b_reward_model.yaml"
JUDGE = EXAMPLES / "chat_grpo_qwen3_8b_judge.yaml"


def roles_by_device(plan):
    return {(b.node, b.device): sorted(slot.name for slot in b.roles) for b in plan.bundles}


def check_invariants(plan):
    """What every feasible plan must hold, whatever the config."""
    assert plan.feasible, plan.reason
    devices = [(b.node, b.device) for b in plan.bundles]
    assert len(set(devices)) == len(devices)
    for node in range(len(plan.cluster.nodes)):
        on_node = [b for b in plan.bundles if b.node == node]
        if plan.device_kind == "gpu":
            assert len(on_node) <= plan.cluster.nodes[node].num_gpus
            assert sorted(b.device for b in on_node) == list(range(len(on_node)))
    for bundle in plan.bundles:
        assert sum(slot.num_gpus for slot in bundle.roles) <= 1.0
        assert bundle.num_cpus == pytest.approx(sum(slot.num_cpus for slot in bundle.roles))
    engines = {slot.rank for b in plan.bundles for slot in b.roles if slot.role == "rollout"}
    for engine in engines:
        assert len({b.node for b in plan.engine_bundles(engine)}) == 1, f"engine {engine} spans nodes"
    for role in {slot.role for b in plan.bundles for slot in b.roles} - {"rollout"}:
        ranks = sorted((slot.rank, b.node, b.device) for b in plan.bundles for slot in b.roles if slot.role == role)
        assert [node_device for _, *node_device in ranks] == sorted(node_device for _, *node_device in ranks), \
            f"{role} ranks are not in node order"


def test_gsm8k_example_is_colocated_on_one_node_of_8():
    plan = make_plan(load_config(GSM8K), ClusterShape.uniform(1, 8))
    check_invariants(plan)
    assert plan.num_devices == 8
    for device, roles in roles_by_device(plan).items():
        rank = device[1]
        assert roles == sorted([f"actor:{rank}", f"reference:{rank}", f"rollout:{rank // 2}/tp{rank % 2}"])
    assert {slot.num_gpus for b in plan.bundles for slot in b.roles} == {0.3333}


def test_async_example_needs_four_nodes_with_disjoint_pools():
    config = load_config(DAPO_ASYNC)
    plan = make_plan(config, ClusterShape.uniform(4, 8))
    check_invariants(plan)
    rollout_nodes = {b.node for b in plan.bundles if b.pool == "rollout"}
    training_nodes = {b.node for b in plan.bundles if b.pool == "training"}
    assert rollout_nodes == {0, 1} and training_nodes == {2, 3}  # each pool on whole nodes of its own
    assert all(slot.num_gpus == 1.0 for b in plan.bundles for slot in b.roles)

    small = make_plan(config, ClusterShape.uniform(1, 8))
    assert not small.feasible
    assert small.reason == "needs 32 GPUs (16 rollout + 16 training) in 4 nodes of 8; the cluster has 8 GPUs (1 node of 8)"


def test_tensor_parallel_larger_than_a_node_is_refused():
    config = load_config(GSM8K, ["rollout.tensor_parallel_size=16", "rollout.num_engines=1", "trainer.num_workers=16"])
    plan = make_plan(config, ClusterShape.uniform(2, 8))
    assert not plan.feasible
    assert "tensor_parallel_size=16" in plan.reason and "largest node has 8" in plan.reason


def test_tensor_parallel_ranks_never_straddle_nodes():
    # Engines of 3 GPUs on nodes of 8: two per node, never one split over a node boundary.
    config = load_config(GSM8K, ["rollout.tensor_parallel_size=3", "rollout.num_engines=4", "trainer.num_workers=4",
                                 "pipeline.mode=async"])
    plan = make_plan(config, ClusterShape.uniform(3, 8))
    check_invariants(plan)
    assert [b.node for engine in range(4) for b in plan.engine_bundles(engine)] == [0] * 6 + [1] * 6
    assert {b.node for b in plan.bundles if b.pool == "training"} == {2}


def test_colocated_roles_follow_the_algorithm():
    ppo = load_config(EXAMPLES / "ppo_critic.yaml", ["trainer.num_workers=2"])
    plan = make_plan(ppo, ClusterShape.uniform(1, 2))
    check_invariants(plan)
    assert roles_by_device(plan)[(0, 0)] == ["actor:0", "critic:0", "reference:0", "rollout:0/tp0"]
    assert roles_by_device(plan)[(0, 1)] == ["actor:1", "critic:1", "reference:1"]
    grpo = make_plan(load_config(EXAMPLES / "quickstart_cpu.yaml"), ClusterShape.uniform(1, 1))
    assert roles_by_device(grpo)[(0, 0)] == ["actor:0", "rollout:0/tp0"]
    assert all(slot.num_gpus == 0.5 for slot in grpo.bundles[0].roles)


def test_cpu_cluster_counts_cpus_and_names_them():
    quickstart = load_config(EXAMPLES / "quickstart_cpu.yaml")
    cpu_machine = ClusterShape((Node("local", 0, 2.0),))
    plan = make_plan(quickstart, cpu_machine)
    check_invariants(plan)
    assert plan.device_kind == "cpu" and plan.bundles[0].resources("cpu") == {"CPU": 2.0}
    too_many = make_plan(load_config(EXAMPLES / "quickstart_cpu.yaml", ["trainer.num_workers=2"]), cpu_machine)
    assert not too_many.feasible
    assert too_many.reason == "needs 3 CPUs; the cluster has 2 CPUs (1 node of 2)"
    # Async on two one-CPU nodes: the engine and the trainer each get a node of their own.
    split = make_plan(load_config(EXAMPLES / "quickstart_cpu.yaml", ["pipeline.mode=async"]),
                      ClusterShape((Node("a", 0, 1.0), Node("b", 0, 1.0))))
    check_invariants(split)
    assert {b.pool: b.node for b in split.bundles} == {"rollout": 0, "training": 1}


def test_gpu_nodes_need_cpus_for_their_roles():
    plan = make_plan(load_config(GSM8K), ClusterShape.uniform(1, 8, num_cpus_per_node=16))
    assert not plan.feasible
    assert plan.reason.startswith("node node-0 needs 20 CPUs for its devices' roles")


def test_memory_estimate_of_qwen3_8b(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    num_parameters = count_parameters(tmp_path)
    assert 8.1e9 < num_parameters < 8.3e9  # Qwen3-8B: 8.19B
    config = load_config(GSM8K, [f"model.path={tmp_path}"])
    plan = make_plan(config, ClusterShape.uniform(1, 8))
    rows = estimate_memory(plan, config, num_parameters, device_memory_bytes=192 << 30)
    assert rows[0]["actor_bytes"] == num_parameters * 16 // 8
    assert rows[0]["reference_bytes"] == num_parameters * 4 // 8
    assert rows[0]["rollout_weights_bytes"] == num_parameters * 2 // 2  # bf16 over two tensor-parallel ranks
    assert all(row["fits"] for row in rows) and memory_verdict(rows, 192 << 30) == ""
    small_devices = estimate_memory(plan, config, num_parameters, device_memory_bytes=24 << 30)
    assert "needs about" in memory_verdict(small_devices, 24 << 30)
    report = plan_report(config, ClusterShape.uniform(1, 8), device_memory_bytes=24 << 30)
    assert not report["feasible"] and "GiB" in report["reason"]


def run_plan_command(*args):
    """`python -m rlactors plan ARGS` in a process of its own (what it prints as vLLM is imported, or
    the Ray it finds, are the caller's concern)."""
    return subprocess.run([sys.executable, "-m", "rlactors", "plan", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def plan_in_process(capsys, *args) -> subprocess.CompletedProcess:
    """The same command in this process, for a given cluster shape (`--nodes`: no live cluster is
    read), without paying for another interpreter and vLLM import."""
    from rlactors.cli import main

    capsys.readouterr()
    returncode = main(["plan", *map(str, args)])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["rlactors", "plan", *map(str, args)], returncode, out, err)


def test_plan_command_json_on_the_examples(capsys):
    fits = plan_in_process(capsys, GSM8K, "--nodes", 1, "--devices-per-node", 8, "--json")
    assert fits.returncode == 0, fits.stderr
    report = json.loads(fits.stdout)
    assert report["feasible"] is True and len(report["devices"]) == 8
    for device in report["devices"]:
        assert {"node", "device", "roles"} <= set(device)
        assert all(role.startswith(("rollout", "actor", "reference", "critic")) for role in device["roles"])
    assert report["weight_transport"] == "ipc"  # colocated GPUs, on every supported vLLM
    apart = run_plan_command(DAPO_ASYNC, "--nodes", 4, "--devices-per-node", 8, "--json")
    assert apart.returncode == 0, apart.stderr
    apart = json.loads(apart.stdout)  # stdout is the report alone, whatever vLLM logs as it is imported
    from rlactors.runtime.vllm_features import trainer_backends

    expected = "nccl" if "nccl" in trainer_backends() else "object_store"
    assert apart["weight_transport"] == expected, apart["weight_transport_reason"]
    assert f"weight sync: {expected} (auto: " in format_report(apart)
    refused = plan_in_process(capsys, DAPO_ASYNC, "--nodes", 1, "--devices-per-node", 8)
    assert refused.returncode == 2
    assert "needs 32 GPUs (16 rollout + 16 training) in 4 nodes of 8; the cluster has 8" in refused.stdout
    as_json = json.loads(plan_in_process(capsys, DAPO_ASYNC, "--nodes", 1, "--devices-per-node", 8, "--json").stdout)
    assert as_json["feasible"] is False and "32 GPUs" in as_json["reason"]


def test_plan_command_reads_this_machine_without_a_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    result = run_plan_command(EXAMPLES / "quickstart_cpu.yaml", "trainer.num_workers=64", "--json")
    assert result.returncode == 2
    assert "CPUs" in json.loads(result.stdout)["reason"]


def test_plan_command_estimates_memory_with_overrides_after_options(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    fits = plan_in_process(capsys, GSM8K, "--nodes", 1, "--devices-per-node", 8, f"model.path={tmp_path}",
                           "--device-memory-gib", 192, "--json")
    assert fits.returncode == 0, fits.stderr
    report = json.loads(fits.stdout)
    assert len(report["memory"]) == 8 and all(row["fits"] for row in report["memory"])
    table = plan_in_process(capsys, GSM8K, "--nodes", 1, "--devices-per-node", 8, f"model.path={tmp_path}",
                            "--device-memory-gib", 40)
    assert table.returncode == 2 and "needs about" in table.stdout and "of 40.0 GiB" in table.stdout


def test_an_moe_model_counts_every_expert_in_memory_and_its_routed_ones_as_active(tmp_path):
    """Qwen3-30B-A3B: 30.5B parameters held (FSDP2 shards all experts over the trainer's ranks),
    3.3B active per token. The example plans fully-async on two 8-GPU nodes of 192 GiB."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    config = load_config(MOE_ASYNC, [f"model.path={tmp_path}"])
    report = plan_report(config, ClusterShape.uniform(2, 8), device_memory_bytes=192 << 30)
    assert report["feasible"], report.get("reason")
    assert 30.4e9 < report["num_parameters"] < 30.6e9 and 3.2e9 < report["num_active_parameters"] < 3.4e9
    training = [row for row in report["memory"] if "actor_bytes" in row]
    assert len(training) == 8 and all(row["actor_bytes"] == report["num_parameters"] * 16 // 8 for row in training)
    assert "30.53B parameters, 3.35B active per token" in format_report(report)
    check_invariants(make_plan(config, ClusterShape.uniform(2, 8)))
    # One 8-GPU node cannot hold it: the trainer's ranks and the engines would share devices.
    assert not plan_report(config, ClusterShape.uniform(1, 8), device_memory_bytes=192 << 30)["feasible"]


def test_the_lora_example_plans_on_4_gpus_where_the_full_fine_tune_does_not_fit(tmp_path):
    """Qwen3-8B on 4 devices of 80 GiB: with LoRA the actor holds the frozen base (4 bytes per
    parameter) and 16 bytes per adapter parameter, and no reference runs; without, the actor's
    16 bytes per parameter and the reference do not fit beside the engines."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    shape = ClusterShape.uniform(1, 4)
    lora = plan_report(load_config(LORA, [f"model.path={tmp_path}"]), shape, device_memory_bytes=80 << 30)
    assert lora["feasible"], lora.get("reason")
    num_parameters, num_adapter_parameters = lora["num_parameters"], lora["num_adapter_parameters"]
    assert 170e6 < num_adapter_parameters < 180e6  # rank 64 on every linear layer of the 36 decoder layers
    for row in lora["memory"]:
        assert "reference_bytes" not in row
        assert row["actor_bytes"] == (num_parameters * 4 + num_adapter_parameters * 16) // 4
    assert "M in LoRA adapters trained" in format_report(lora)
    full = plan_report(load_config(LORA, [f"model.path={tmp_path}", "model.lora.rank=0"]), shape,
                       device_memory_bytes=80 << 30)
    assert not full["feasible"] and "needs about" in full["reason"]
    assert all(row["reference_bytes"] > 0 for row in full["memory"])


def reward_models(*entries: str) -> str:
    return "reward.models=[" + ", ".join("{" + entry + "}" for entry in entries) + "]"


def test_reward_model_replicas_share_the_pool_or_take_devices_of_their_own():
    # Colocated: the replicas of both shared models go round the pool's devices, one each in turn.
    colocated = load_config(GSM8K, [reward_models("name: a, path: /a, num_replicas: 2", "name: b, path: /b")])
    plan = make_plan(colocated, ClusterShape.uniform(1, 8))
    check_invariants(plan)
    roles = roles_by_device(plan)
    assert [d for d, names in roles.items() if any(n.startswith("reward/") for n in names)] == [(0, 0), (0, 1), (0, 2)]
    assert "reward/a:0" in roles[(0, 0)] and "reward/a:1" in roles[(0, 1)] and "reward/b:0" in roles[(0, 2)]
    assert {slot.num_gpus for slot in plan.bundles[0].roles} == {0.25}  # actor, reference, rollout, reward/a
    assert {"reward/a", "reward/b"} <= set(plan.roles_needed)
    # Async: shared replicas sit on the training devices; own_devices makes a `reward` pool after the others.
    apart = load_config(DAPO_ASYNC, [reward_models("name: a, path: /a, num_replicas: 2",
                                                   "name: judge, path: /j, own_devices: true, num_replicas: 2")])
    plan = make_plan(apart, ClusterShape.uniform(5, 8))
    check_invariants(plan)
    training = [b for b in plan.bundles if b.pool == "training"]
    assert [slot.name for slot in training[0].roles][-1] == "reward/a:0" and "reward/a:1" in training[1].roles[-1].name
    reward_pool = [b for b in plan.bundles if b.pool == "reward"]
    assert [[slot.name for slot in b.roles] for b in reward_pool] == [["reward/judge:0"], ["reward/judge:1"]]
    assert {b.node for b in reward_pool} == {4} and all(b.roles[0].num_gpus == 1.0 for b in reward_pool)
    assert not make_plan(apart, ClusterShape.uniform(4, 8)).feasible  # 34 devices on 32
    # On CPU a device of its own is a bundle of its CPUs: none asked for is refused, naming the replica.
    cpu = ClusterShape((Node("local", 0, 8.0),))
    quickstart = EXAMPLES / "quickstart_cpu.yaml"
    refused = make_plan(load_config(quickstart, [reward_models("name: rm, path: /rm, own_devices: true")]), cpu)
    assert not refused.feasible and "reward/rm:0 ask for none" in refused.reason
    own = make_plan(load_config(quickstart, [reward_models("name: rm, path: /rm, own_devices: true, "
                                                           "num_cpus_per_replica: 2")]), cpu)
    check_invariants(own)
    assert own.bundles[-1].pool == "reward" and own.bundles[-1].resources("cpu") == {"CPU": 2.0}


def test_the_reward_model_example_plans_on_one_node_of_8_with_the_models_weights_counted(tmp_path, capsys):
    policy, reward_model = tmp_path / "policy", tmp_path / "reward_model"
    for folder, architecture in ((policy, "Qwen3ForCausalLM"), (reward_model, "Qwen3ForSequenceClassification")):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(QWEN3_8B | {"architectures": [architecture], "num_labels": 1}))
    overrides = [f"model.path={policy}", reward_models(f"name: helpfulness, path: {reward_model}, dtype: bfloat16, "
                                                       "num_replicas: 2")]
    report = plan_report(load_config(REWARD_MODEL, overrides), ClusterShape.uniform(1, 8), device_memory_bytes=192 << 30)
    assert report["feasible"], report.get("reason")
    num_reward_parameters = report["reward_model_parameters"]["helpfulness"]
    assert 7.5e9 < num_reward_parameters < report["num_parameters"]  # the same backbone, a 1-output head
    with_models = [row for row in report["memory"] if "reward_models_bytes" in row]
    assert len(with_models) == 2 and all(row["reward_models_bytes"] == num_reward_parameters * 2 for row in with_models)
    without = report["memory"][2]
    assert with_models[0]["peak_bytes"] - without["peak_bytes"] == num_reward_parameters * 2
    assert "reward_models" in format_report(report)


def test_the_judge_example_plans_on_one_node_of_8_with_each_judge_engines_share_counted(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    overrides = [f"model.path={tmp_path}", reward_models(f"name: judge, kind: judge, path: {tmp_path}, "
                                                         "dtype: bfloat16, num_replicas: 2")]
    config = load_config(JUDGE, overrides)
    report = plan_report(config, ClusterShape.uniform(1, 8), device_memory_bytes=80 << 30)
    assert report["feasible"], report.get("reason")
    assert report["reward_model_parameters"]["judge"] == report["num_parameters"]  # a causal LM, as the policy
    judged = [row for row in report["memory"] if "reward_models_bytes" in row]
    assert [row["reward_models_bytes"] for row in judged] == [int(0.3 * (80 << 30))] * 2  # its engine's share
    assert [device["roles"][-1] for device in report["devices"][:2]] == ["reward/judge:0", "reward/judge:1"]
    # Colocated (trainer.offload), the judges sleep while the trainer runs: they count beside the
    # engines, not beside the trainer. In async mode every role counts beside every other.
    plan = make_plan(config, ClusterShape.uniform(1, 8))
    generating = int((0.45 + 0.3) * (80 << 30))  # the policy's engine and the judge's
    rows = estimate_memory(plan, config, report["num_parameters"], device_memory_bytes=80 << 30)
    assert rows[0]["peak_bytes"] == generating > rows[0]["actor_bytes"] + rows[0]["reference_bytes"]
    heavy = estimate_memory(plan, config, 8 * report["num_parameters"], device_memory_bytes=80 << 30,
                            reward_model_parameters={"judge": report["num_parameters"]})
    trainer = heavy[0]["actor_bytes"] + heavy[0]["reference_bytes"]
    assert heavy[0]["peak_bytes"] == heavy[2]["peak_bytes"] == trainer > generating  # no judge in the trainer's turn
    assert not heavy[0]["fits"]
    asynchronous = estimate_memory(dataclasses.replace(plan, mode="async"), config, report["num_parameters"],
                                   device_memory_bytes=80 << 30)
    assert asynchronous[0]["peak_bytes"] - asynchronous[2]["peak_bytes"] == int(0.3 * (80 << 30))
    # Without the device's size, the judge's weights alone.
    rows = estimate_memory(make_plan(config, ClusterShape.uniform(1, 8)), config, report["num_parameters"],
                           reward_model_parameters={"judge": report["num_parameters"]})
    assert rows[0]["reward_models_bytes"] == report["num_parameters"] * 2
