"""A run scored by a classifier and an LLM judge beside the rule, through the whole stack (Ray,
vLLM, FSDP2, the reward actors, the buffer) on the tiny model: each part of the reward logged
beside their sum, every trained sample's score the weighted sum of its parts, the classifier's part
its logit on what the policy saw and wrote, the judge's its verdict on the output it kept.

Below this run: the classifier, the pool's stages, a replica's restart and the checkpoint
(tests/reward/test_model_scorer.py), the judge on an engine (tests/reward/test_judge.py), the
metrics (tests/pipelines/test_common.py), the plan (tests/placement/test_plan.py)."""

from pathlib import Path

import pytest
from tiny_runs import record_scored_batches, tiny_config

from rlactors.pipelines import run_pipeline

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # its plan has reward-model roles: vLLM starts for it

VERDICT = "def length(output):\n    return float(len(output))\n"


def test_a_run_scored_by_reward_models_logs_each_part_and_trains_on_their_sum(warm_actors, tiny_model_dir,
                                                                               tmp_path, monkeypatch):
    from rlactors.config import RewardModelConfig
    from rlactors.models import build_tiny_model, load_tokenizer
    from rlactors.reward.model_scorer import load_classifier, score_sequences

    reward_model_dir = build_tiny_model(tmp_path / "reward_model", seed=1, head="classifier")
    (tmp_path / "verdicts.py").write_text(VERDICT)
    judge = (f"{{name: judge, kind: judge, path: {tiny_model_dir}, weight: 0.01, judge: {{verdict: "
             f"'{tmp_path / 'verdicts.py'}:length', max_response_tokens: 4, chat_template: false, max_model_len: 512}}}}")
    config = tiny_config(tmp_path, tiny_model_dir, "reward.function_weight=0.5", "reward.models=["
                         f"{{name: quality, path: {reward_model_dir}, weight: 2.0, batch_size: 4}}, {judge}]")
    batches = record_scored_batches(monkeypatch)
    history = run_pipeline(config, warm=warm_actors)

    assert [h["step"] for h in history] == [0, 1, 2]
    for step in history[1:]:
        assert step["reward/mean"] == pytest.approx(0.5 * step["reward/function/mean"] + 2.0 * step["reward/quality/mean"]
                                                    + 0.01 * step["reward/judge/mean"], abs=1e-6)
        assert step["reward/judge/mean"] > 0  # the judge wrote something for every response
    model, tokenizer = load_classifier(RewardModelConfig(name="quality", path=str(reward_model_dir)))
    policy_tokenizer = load_tokenizer(tiny_model_dir)
    samples = [s for num_errors, groups in batches for g in groups for s in g.samples]
    assert len(samples) == 2 * 4 * 4 and all(num_errors == 0 for num_errors, _ in batches)
    texts = [policy_tokenizer.decode(s.prompt_token_ids) + s.text for s in samples]
    logits = [value for value, _ in score_sequences(model, tokenizer, texts, batch_size=1, max_tokens=4096)[0]]
    for sample, logit in zip(samples, logits, strict=True):
        parts = sample.score_details["reward_parts"]
        assert parts["quality"] == pytest.approx(logit, abs=1e-4)
        assert parts["judge"] == len(sample.score_details["reward_outputs"]["judge"])
        assert sample.score == pytest.approx(0.5 * parts["function"] + 2.0 * parts["quality"] + 0.01 * parts["judge"],
                                             abs=1e-6)


DIGIT_RULE = Path(__file__).resolve().parents[2] / "benchmarks" / "digit_reward.py"
LEARN_STEPS = 6


def test_grpo_against_a_preference_trained_classifier_raises_its_score_and_the_rule_it_reflects(
        warm_actors, tiny_model_dir, tmp_path):
    """A classifier trained on pairs that prefer digits (`rlactors train-reward-model`) is the only
    reward of a GRPO run; the digit-share rule rides along at weight 0, logged as its part and as
    greedy validation accuracy on held-out prompts. Both the classifier's score and the rule rise."""
    from rlactors.config import RewardTrainingConfig, load_config
    from rlactors.pipelines.reward_model_training import train_reward_model

    reward_model = tmp_path / "reward_model"
    report = train_reward_model(load_config(None, [f"model_path={tiny_model_dir}", f"output_path={reward_model}",
                                                   "num_epochs=3", "trainer.optim.lr=3e-4"], model=RewardTrainingConfig))
    assert report["val/preference_accuracy"] >= 0.85
    history = run_pipeline(tiny_config(
        tmp_path, tiny_model_dir, f"pipeline.num_steps={LEARN_STEPS}", "trainer.optim.lr=1e-2",
        "rollout.sampling.num_samples_per_prompt=8", "pipeline.batch_size_prompts=8",
        f"reward.custom_function={DIGIT_RULE}:compute_score", "reward.function_weight=0",
        f"reward.models=[{{name: digits, path: {reward_model}}}]"), warm=warm_actors)
    steps = history[1:]
    for step in steps:
        assert step["reward/mean"] == pytest.approx(step["reward/digits/mean"], abs=1e-6)  # the rule weighs 0
    scores, rule = [s["reward/digits/mean"] for s in steps], [s["reward/function/mean"] for s in steps]
    # measured: the classifier's score -2.5 -> 4.2, the rule 0.02 -> 0.88, held-out 0.0 -> 1.0 by step 6
    assert sum(scores[-2:]) / 2 > scores[0] + 1.0, scores
    assert sum(rule[-2:]) / 2 > rule[0] + 0.4, rule
    held_out = [h["val/synthetic/arithmetic/acc"] for h in history if "val/synthetic/arithmetic/acc" in h]
    assert len(held_out) == 2 and held_out[1] > held_out[0] + 0.4, held_out
