"""Algorithm options through the real stack, several per run: 2 steps on the tiny model each. That
every config name reaches its function is tested without Ray (tests/trainer/test_policy_objective.py
for policy losses, tests/pipelines/test_batch_builder.py for advantage estimators and the decoupled
correction, tests/algorithms for the maths); these runs show the options train together end to end:
the old-logprob pass where a correction asks for it and none in bypass mode, ReMax's greedy baseline
generated and used, a KL loss with a reference trainer, several mini-batches, async staleness.
GSPO's and CISPO's shipped examples: their algorithm sections in tests/examples, without a run."""

import math

import pytest
from tiny_runs import tiny_config

from rlactors.pipelines import run_pipeline

pytestmark = pytest.mark.vllm

CORRECTION = "algorithm.rollout_correction."
CASES = {
    # On the engines of tests/pipelines' plain colocated runs (the same engine settings and plan).
    "geo_mean+opo+sequence_icepop": [
        "algorithm.policy_loss=geo_mean", "algorithm.advantage=opo", f"{CORRECTION}importance_level=sequence",
        f"{CORRECTION}importance_threshold=5.0", f"{CORRECTION}importance_threshold_lower=0.2"],
    "bypass_reinforce+grpo_passk+rejection+two_mini_batches": [
        f"{CORRECTION}bypass_mode=true", f"{CORRECTION}loss_type=reinforce", f"{CORRECTION}importance_level=token",
        f"{CORRECTION}rejection=seq_max_k2", f"{CORRECTION}rejection_threshold=20.0", "algorithm.advantage=grpo_passk",
        "trainer.num_mini_batches=2"],
    # ReMax adds a greedy sample to each group (the batch builder refuses a ReMax batch without it), a
    # KL loss a reference trainer: engines of their own.
    "sapo+remax+token_tis+chained_rejection+k3_straight_through": [
        "algorithm.policy_loss=sapo", "algorithm.advantage=remax", f"{CORRECTION}importance_level=token",
        f"{CORRECTION}rejection=token_k1,seq_mean_k3", f"{CORRECTION}rejection_threshold='0.1_10,5.0'",
        "algorithm.use_kl_loss=true", "algorithm.kl_loss_type=k3+"],
    "dppo_kl+rloo+normalized_weights_async": [
        "algorithm.policy_loss=dppo_kl", "algorithm.advantage=rloo", f"{CORRECTION}importance_level=token",
        f"{CORRECTION}batch_normalize=true", "pipeline.mode=async", "rollout.partial_rollout=true",
        "buffer.max_staleness=1", "buffer.staleness_threshold=1.0"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_algorithm_options_train_two_steps_together(warm_actors, tmp_path, tiny_model_dir, case):
    config = tiny_config(tmp_path, tiny_model_dir, *CASES[case])
    history = run_pipeline(config, warm=warm_actors)
    assert [h["step"] for h in history] == [0, 1, 2]
    last = history[-1]
    assert math.isfinite(last["actor/pg_loss"]) and last["actor/num_optimizer_steps"] >= 2, last
    assert last["actor/num_skipped_steps"] == 0
    correction = config.algorithm.rollout_correction
    # Decoupled correction runs the old-logprob pass and reports over the batch; bypass mode runs no
    # such pass and reports from the update.
    if correction.enabled:
        assert ("timing_s/old_log_prob" in last) == (not correction.bypass_mode)
        assert "rollout_corr/rollout_is_mean" in last or "rollout_corr/rollout_rs_masked_fraction" in last, last
    if correction.importance_level == "token" and not (correction.bypass_mode or correction.batch_normalize):
        assert last["rollout_corr/rollout_is_max"] <= correction.importance_threshold + 1e-6
    if config.algorithm.use_kl_loss:
        assert math.isfinite(last["actor/kl_loss"])
