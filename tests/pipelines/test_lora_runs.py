"""LoRA runs through the whole stack (Ray, vLLM serving the adapter, FSDP2, buffer) on the tiny
model: a colocated GRPO run whose engines get the adapter alone at every sync (verified) and
compute the trainer's logprobs, whose reference policy is the actor's base, and which learns; its
exact resume; its Hugging Face export (merged model and peft adapter, live and from the checkpoint);
and (CI) a fully-async run with partial rollouts whose responses span adapter swaps, each token
checked against the weights its version names.

Below these runs: the adapters on a model against peft's own merge and loader
(tests/models/test_lora.py), and a LoRA trainer group's optimizer, reference and checkpoint
(tests/trainer/test_trainer_lora.py).
"""

from pathlib import Path

import pytest
import torch
from tiny_runs import tiny_config, with_resume

from rlactors.pipelines import run_pipeline

pytestmark = pytest.mark.vllm

DIGIT_REWARD = Path(__file__).resolve().parents[2] / "benchmarks" / "digit_reward.py"
LORA = ["model.lora.rank=8", "model.lora.alpha=16", "trainer.optim.lr=3e-2", "algorithm.use_kl_loss=true",
        "algorithm.kl_loss_coef=0.01"]
NUM_STEPS = 6


def learning_config(tmp_path, model_dir, *overrides):
    """A reward the untrained model earns little of (the share of digits in the response), 8 x 8 samples."""
    return tiny_config(tmp_path, model_dir, *LORA, f"pipeline.num_steps={NUM_STEPS}", "pipeline.checkpoint_every_steps=4",
                       f"reward.custom_function={DIGIT_REWARD}:compute_score", "rollout.sampling.num_samples_per_prompt=8",
                       "pipeline.batch_size_prompts=8", *overrides)


@pytest.fixture(scope="module")
def colocated(warm_actors, tiny_model_dir, tmp_path_factory):
    config = learning_config(tmp_path_factory.mktemp("lora"), tiny_model_dir, "rollout.verify_weight_sync=true")
    return config, run_pipeline(config, warm=warm_actors)


def test_the_engines_serve_the_trainers_adapter_and_the_run_learns(colocated):
    """Every step's rollout logprobs are the trainer's (fp32, CPU) on every token: from step 2 on the
    engines serve an adapter the trainer sent alone (each sync verified). The KL loss against the base (adapters off)
    grows from 0 as the adapter moves; the reward climbs."""
    _, history = colocated
    assert [h["step"] for h in history] == list(range(NUM_STEPS + 1))
    for h in history[1:]:
        assert h["rollout/logprob_abs_diff_max"] < 1e-4, (h["step"], h["rollout/logprob_abs_diff_max"])
        assert h["weight_sync/num_failed_engines"] == 0  # the file each engine loaded is the one written
    assert history[1]["actor/kl_loss"] == 0 < history[2]["actor/kl_loss"]
    rewards = [h["reward/mean"] for h in history[1:]]
    assert sum(rewards[-2:]) / 2 > rewards[0] + 0.5, rewards  # measured: 0.02 -> 0.98 by step 5


def test_a_resumed_lora_run_reproduces_the_next_steps_exactly(colocated, warm_actors):
    config, uninterrupted = colocated
    resumed = run_pipeline(with_resume(config), warm=warm_actors)
    assert [h["step"] for h in resumed] == [5, 6]
    for got, expected in zip(resumed, uninterrupted[5:], strict=True):
        for name in ("reward/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "rollout/logprob_abs_diff_max"):
            assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-6), (got["step"], name)


def test_the_export_is_the_merged_model_and_the_peft_adapter(colocated, tiny_model_dir, tmp_path):
    from peft import PeftModel

    from rlactors.models import load_model
    from rlactors.trainer.hf_export import export_checkpoint

    config, _ = colocated
    live = Path(config.pipeline.output_dir) / "hf" / f"step_{NUM_STEPS}"
    merged = load_model(live)
    adapted = PeftModel.from_pretrained(load_model(tiny_model_dir), str(live / "adapter"))
    ids = torch.tensor([[5, 17, 42, 9, 100, 3]])
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, merged(ids).logits, rtol=0, atol=1e-4)
        assert (merged(ids).logits - load_model(tiny_model_dir)(ids).logits).abs().max() > 1e-2  # it trained
    # The checkpoint of step 4 (the adapter alone) exports the same way.
    exported = export_checkpoint(config.pipeline.output_dir, tmp_path / "export")
    assert (exported / "adapter" / "adapter_model.safetensors").is_file()
    from_checkpoint = PeftModel.from_pretrained(load_model(tiny_model_dir), str(exported / "adapter"))
    with torch.no_grad():
        torch.testing.assert_close(from_checkpoint(ids).logits, load_model(exported)(ids).logits, rtol=0, atol=1e-4)


@pytest.mark.slow  # CI runs it; make test keeps the colocated run above (a swap between responses)
def test_fully_async_adapter_swaps_mid_response_keep_each_token_s_version(warm_actors, tmp_path, tiny_model_dir,
                                                                          reference, monkeypatch):
    """Fully-async with partial rollouts, an adapter sync every step, responses long enough to be
    cut by one: responses span adapter versions, and each token's logprob is that of the merged
    weights its version names (float64), and far from those of the response's other version."""
    from tiny_runs import check_tokens_against_their_versions, record_published_weights, record_scored_batches

    published = record_published_weights(monkeypatch)  # the actor's export: its merged weights
    batches = record_scored_batches(monkeypatch)
    history = run_pipeline(tiny_config(
        tmp_path, tiny_model_dir, *LORA, "pipeline.mode=async", "rollout.partial_rollout=true", "pipeline.num_steps=3",
        "buffer.max_staleness=1", "buffer.staleness_threshold=1.0", "rollout.sampling.max_response_tokens=48",
        "rollout.sampling.ignore_eos=true"), warm=warm_actors)
    assert max(h["staleness/max"] for h in history[1:]) <= 1
    model, _ = reference
    published.setdefault(0, model.state_dict())  # the engines start on the base: the adapter's B starts at 0
    assert check_tokens_against_their_versions(batches, published, model, min_separation=1e-3), \
        "no response spans an adapter swap"
