"""A mixture-of-experts model through the whole stack (Ray, vLLM, FSDP2, buffer) on the tiny
Qwen3-MoE (8 experts, 2 routed per token), with routing replay: a colocated GRPO run whose engines
hold the trainer's weights after every sync (the fused experts sent one tensor per expert) and
record the experts of every token, which reach the trainer; a run on its kept engines that learns;
its exact resume and its Hugging Face export; and a fully-async PPO run with a critic, stale
samples, partial rollouts, gradient checkpointing and replay.

Below these runs: the weight mapping bit for bit and the preset (tests/models/test_moe.py), the
trainer routing exactly by a record, per token and layer (tests/trainer/test_routing_replay.py),
and a sample's routing across resumed requests (tests/test_routes.py).
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_runs import tiny_config, with_resume

from rlactors.pipelines import run_pipeline

pytestmark = pytest.mark.vllm

MOE = ["model.preset=tiny", "model.architecture=qwen3_moe", "trainer.routing_replay=rollout"]
AUX = 0.01
LEARN_STEPS = 8
DIGIT_REWARD = Path(__file__).resolve().parents[2] / "benchmarks" / "digit_reward.py"


@pytest.fixture(scope="module")
def colocated(warm_actors, tiny_moe_model_dir, tmp_path_factory):
    """3 colocated GRPO steps with the router's load-balancing loss, a checkpoint at step 2."""
    warm_actors.close()
    config = tiny_config(tmp_path_factory.mktemp("moe"), tiny_moe_model_dir, *MOE, "pipeline.num_steps=3",
                         "pipeline.checkpoint_every_steps=2", f"trainer.router_aux_loss_coef={AUX}")
    return config, run_pipeline(config, warm=warm_actors)


def test_engines_hold_the_trainers_weights_after_every_sync(colocated):
    """Each step's rollout logprobs equal the trainer's, replayed on the engine's routing (fp32,
    CPU), on every token: from step 2 on the engines hold weights the trainer sent, so its fused
    experts arrived whole and in place. On-policy, the engine's recorded experts are the trainer's
    own choice on every trained token and layer, and none is missing."""
    _, history = colocated
    assert [h["step"] for h in history] == [0, 1, 2, 3]
    for h in history[1:]:
        assert h["rollout/logprob_abs_diff_max"] < 1e-4, (h["step"], h["rollout/logprob_abs_diff_max"])
        assert h["actor/grad_norm"] > 0
        assert h["actor/routing_mismatch_share"] == 0 and h["actor/routing_unrecorded_share"] == 0, h["step"]
        assert 1 / 8 <= h["actor/expert_load_max"] <= 1 and 0 <= h["actor/expert_load_min"] <= 1 / 8
        # The Switch loss is 1 when balanced and at most num_experts: its share of the step's loss.
        assert 0.5 * AUX < h["actor/router_aux_loss"] < 8 * AUX


def test_the_moe_model_learns_with_replay_on_the_kept_engines(colocated, warm_actors, tiny_moe_model_dir, tmp_path):
    """A reward the untrained model earns little of (the share of digits in the response) climbs
    within a few colocated steps: routing replay does not stop the model, its router included,
    from learning. The engines and trainer ranks are the fixture's, kept (`warm_actors`)."""
    history = run_pipeline(tiny_config(
        tmp_path, tiny_moe_model_dir, *MOE, f"pipeline.num_steps={LEARN_STEPS}", "trainer.optim.lr=1e-2",
        f"reward.custom_function={DIGIT_REWARD}:compute_score", "rollout.sampling.num_samples_per_prompt=8",
        "pipeline.batch_size_prompts=8"), warm=warm_actors)
    rewards = [h["reward/mean"] for h in history[1:]]
    assert sum(rewards[-3:]) / 3 > rewards[0] + 0.5, rewards  # measured: 0.05 -> 0.99 by step 4


def test_a_resumed_moe_run_reproduces_the_next_step_exactly(colocated, warm_actors):
    config, uninterrupted = colocated
    resumed = run_pipeline(with_resume(config), warm=warm_actors)
    assert [h["step"] for h in resumed] == [3]
    for name in ("reward/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy",
                 "rollout/logprob_abs_diff_max"):
        assert resumed[0][name] == pytest.approx(uninterrupted[3][name], rel=1e-5, abs=1e-6), name


def test_the_export_holds_one_tensor_per_expert_and_the_trainers_weights(colocated, tiny_moe_model_dir, tmp_path):
    """The run's HF folder and an export of its latest checkpoint name each expert's tensors as the
    built folder (and vLLM's loader) do, and transformers loads them back into fused experts."""
    from rlactors.models import load_model
    from rlactors.trainer.hf_export import export_checkpoint

    config, _ = colocated
    built = set(load_file(str(tiny_moe_model_dir / "model.safetensors")))
    live = config.pipeline.output_dir + "/hf/step_3"
    index = json.loads(open(live + "/model.safetensors.index.json").read())["weight_map"]
    assert set(index) == built and "model.layers.1.mlp.experts.7.up_proj.weight" in index
    from_checkpoint = export_checkpoint(config.pipeline.output_dir, tmp_path / "export")
    trained, started = load_model(from_checkpoint).state_dict(), load_model(tiny_moe_model_dir).state_dict()
    assert set(trained) == set(started)
    moved = [name for name in trained if not torch.equal(trained[name], started[name])]
    assert "model.layers.0.mlp.experts.gate_up_proj" in moved and "model.layers.0.mlp.gate.weight" in moved


@pytest.mark.slow  # make test: the colocated MoE runs above; the trainer routing by a record: tests/trainer
def test_fully_async_ppo_with_a_critic_trains_the_moe_model(warm_actors, tiny_moe_model_dir, tmp_path):
    history = run_pipeline(tiny_config(
        tmp_path, tiny_moe_model_dir, *MOE, "pipeline.mode=async", "rollout.partial_rollout=true",
        "pipeline.num_steps=3", "buffer.max_staleness=1", "buffer.staleness_threshold=1.0", "algorithm.name=ppo",
        "algorithm.advantage=gae", "trainer.critic_optim.lr=1e-3", "trainer.gradient_checkpointing=true"),
        warm=warm_actors)
    assert [h["step"] for h in history] == [0, 1, 2, 3]
    assert max(h["staleness/max"] for h in history[1:]) <= 1
    for h in history[1:]:
        assert h["critic/vf_loss"] > 0 and h["actor/grad_norm"] > 0
        assert 0 <= h["actor/routing_mismatch_share"] <= 1 and h["actor/routing_unrecorded_share"] == 0
        if h["staleness/max"] == 0:  # every sample made by the weights the trainer holds: no disagreement
            assert h["actor/routing_mismatch_share"] == 0, h["step"]
