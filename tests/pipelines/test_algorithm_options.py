"""Every algorithm option of `rlactors.algorithms` end to end: 2 steps of the real stack on the tiny
model per case. Each case combines one policy loss with one advantage estimator and one KL or
rollout-correction setting, so every new option runs once (GSPO and CISPO also run as shipped
examples, `tests/examples`). Each run starts its own engine (~35 s on 2 cores)."""

import math

import pytest
from test_pipelines import tiny_config

from rlactors.pipelines import run_pipeline

pytestmark = pytest.mark.vllm

CORRECTION = "algorithm.rollout_correction."
CASES = {
    "sapo+reinforce_plus_plus_baseline+token_tis": [
        "algorithm.policy_loss=sapo", "algorithm.advantage=reinforce_plus_plus_baseline",
        f"{CORRECTION}importance_level=token"],
    "geo_mean+opo+sequence_icepop": [
        "algorithm.policy_loss=geo_mean", "algorithm.advantage=opo", f"{CORRECTION}importance_level=sequence",
        f"{CORRECTION}importance_threshold=5.0", f"{CORRECTION}importance_threshold_lower=0.2"],
    "gpg+gpg+k1_straight_through": [
        "algorithm.policy_loss=gpg", "algorithm.advantage=gpg", "algorithm.use_kl_loss=true",
        "algorithm.kl_loss_type=k1+"],
    "clip_cov+grpo_passk+k3_straight_through": [
        "algorithm.policy_loss=clip_cov", "algorithm.clip_cov_ratio=0.2", "algorithm.clip_cov_lower=-10",
        "algorithm.advantage=grpo_passk", "algorithm.use_kl_loss=true", "algorithm.kl_loss_type=k3+"],
    "kl_cov+remax": ["algorithm.policy_loss=kl_cov", "algorithm.kl_cov_ratio=0.2", "algorithm.advantage=remax"],
    "dppo_tv+reinforce_plus_plus+chained_rejection": [
        "algorithm.policy_loss=dppo_tv", "algorithm.advantage=reinforce_plus_plus",
        f"{CORRECTION}rejection=token_k1,seq_mean_k3", f"{CORRECTION}rejection_threshold='0.1_10,5.0'"],
    "dppo_kl+rloo+normalized_weights_async": [
        "algorithm.policy_loss=dppo_kl", "algorithm.advantage=rloo", f"{CORRECTION}importance_level=token",
        f"{CORRECTION}batch_normalize=true", "pipeline.mode=async", "buffer.max_staleness=1",
        "buffer.staleness_threshold=1.0"],
    "bypass_ppo_clip+rejection": [
        f"{CORRECTION}bypass_mode=true", f"{CORRECTION}importance_level=token",
        f"{CORRECTION}rejection=seq_max_k2", f"{CORRECTION}rejection_threshold=20.0"],
    "bypass_reinforce+two_mini_batches": [
        f"{CORRECTION}bypass_mode=true", f"{CORRECTION}loss_type=reinforce", f"{CORRECTION}importance_level=token",
        "trainer.num_mini_batches=2"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_algorithm_option_trains_two_steps(ray_session, tmp_path, tiny_model_dir, case):
    config = tiny_config(tmp_path, tiny_model_dir, *CASES[case])
    history = run_pipeline(config)
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
