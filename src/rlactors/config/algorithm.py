"""Configuration of the algorithm: advantage estimator, policy loss, KL terms and rollout correction
(`rlactors.config.sections` holds the others). Every option maps onto one function of
`rlactors.algorithms`; the README's algorithm table names the paper and veRL's name of each."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlactors.config.section import Section

KL_ESTIMATORS = Literal["k1", "k2", "k3", "low_var_kl", "abs", "k1+", "k2+", "k3+", "low_var_kl+", "abs+"]
ADVANTAGE_ESTIMATORS = Literal[
    "grpo", "rloo", "gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "gpg", "grpo_passk", "remax"
]
POLICY_LOSSES = Literal[
    "vanilla", "gspo", "sapo", "cispo", "geo_mean", "gpg", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl"
]


class RolloutCorrectionConfig(Section):
    """Corrections for the gap between the policy that sampled a batch (the rollout engine's
    logprobs) and the trainer's (veRL's `algorithm.rollout_correction`). Decoupled mode (three
    policies) weights and rejects with the trainer's old logprobs against the rollout's, once per
    batch; bypass mode (two policies) skips the old-logprob pass and takes the rollout logprobs as the
    old ones, weighing the current policy against them in every micro-batch."""

    importance_level: Literal["token", "sequence"] | None = Field(
        None, description="Importance weights exp(trainer - rollout logprob) per token or per sequence (the sum of "
        "its log ratios); null is off (veRL: rollout_is)."
    )
    importance_threshold: float = Field(
        2.0, gt=0, description="Upper bound of the importance weights: larger weights are truncated to it (TIS), or "
        "zeroed with `importance_threshold_lower` set (veRL: rollout_is_threshold)."
    )
    importance_threshold_lower: float | None = Field(
        None, gt=0, description="IcePop: weights outside [lower, importance_threshold] are set to 0 instead of "
        "truncated; null truncates."
    )
    batch_normalize: bool = Field(
        False, description="Scale the importance weights to mean 1 over the batch (veRL: rollout_is_batch_normalize)."
    )
    rejection: str | None = Field(
        None, description="Rejection of tokens or whole sequences whose log ratio is beyond a threshold, veRL's "
        "comma-separated options (token_k1, seq_sum_k1, seq_mean_k3, ...); chained, each must keep a token. "
        "Rejected tokens leave the loss (veRL: rollout_rs)."
    )
    rejection_threshold: str | float | None = Field(
        None, description="Thresholds of `rejection`, comma-separated in the same order; k1 options take "
        "`lower_upper` (veRL: rollout_rs_threshold)."
    )
    bypass_mode: bool = Field(
        False, description="Two policies: the rollout logprobs are the old ones (no old-logprob pass); weights and "
        "rejection compare the current policy with them in every micro-batch."
    )
    loss_type: Literal["ppo_clip", "reinforce"] = Field(
        "ppo_clip", description="Bypass mode's loss: PPO's clipped ratio against the rollout policy (its weights "
        "are then metrics only), or REINFORCE weighted by the importance weights."
    )

    @property
    def enabled(self) -> bool:
        return self.importance_level is not None or self.rejection is not None or self.bypass_mode

    @model_validator(mode="after")
    def _thresholds_parse(self) -> RolloutCorrectionConfig:
        if (self.rejection is None) != (self.rejection_threshold is None):
            raise ValueError("rejection and rejection_threshold go together: set both or neither")
        if self.rejection is not None:
            # Imported here: rlactors.algorithms imports torch, which a configuration needs only with rejection.
            from rlactors.algorithms.rollout_correction_options import parse_rejection

            parse_rejection(self.rejection, self.rejection_threshold)
        lower = self.importance_threshold_lower
        if lower is not None and lower > self.importance_threshold:
            raise ValueError(f"importance_threshold_lower ({lower}) must not exceed importance_threshold "
                             f"({self.importance_threshold})")
        return self


class AlgorithmConfig(Section):
    name: Literal["grpo", "dapo", "ppo"] = Field("grpo", description="Algorithm family (for logs and drivers).")
    advantage: ADVANTAGE_ESTIMATORS = Field(
        "grpo", description="Advantage estimator (veRL's adv_estimator names). remax generates one greedy response "
        "per prompt as its baseline (`rollout.sampling.greedy_baseline`, set by it)."
    )
    norm_by_std: bool = Field(True, description="GRPO and GRPO pass@k: divide by the group std (off is Dr.GRPO).")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount of GAE and REINFORCE++ returns.")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
    policy_loss: POLICY_LOSSES = Field(
        "vanilla", description="Policy loss (veRL's policy_loss.loss_mode). sapo and geo_mean aggregate "
        "seq-mean-token-mean whatever loss_agg_mode says, as their definitions do (GSPO's paper uses it too)."
    )
    clip_ratio_low: float = Field(
        0.2, ge=0, description="PPO clip below 1 (also GSPO, CISPO, GMPO, Clip-Cov); DPPO's divergence bound below."
    )
    clip_ratio_high: float = Field(
        0.2, ge=0, description="PPO clip above 1 (DAPO clip-higher uses 0.28); DPPO's divergence bound above."
    )
    clip_ratio_c: float = Field(
        3.0, gt=1, description="Dual-clip bound for negative advantages; DPPO's cap of its truncated ratio."
    )
    tau_positive: float = Field(1.0, gt=0, description="SAPO: gate temperature for positive advantages.")
    tau_negative: float = Field(1.05, gt=0, description="SAPO: gate temperature for other advantages.")
    clip_cov_ratio: float = Field(0.0002, gt=0, description="Clip-Cov: share of tokens whose gradient is cut.")
    clip_cov_lower: float = Field(1.0, description="Clip-Cov: covariance above which a token may be cut.")
    clip_cov_upper: float = Field(5.0, description="Clip-Cov: covariance below which a token may be cut.")
    kl_cov_ratio: float = Field(0.0002, gt=0, description="KL-Cov: share of tokens given the KL penalty.")
    ppo_kl_coef: float = Field(1.0, ge=0, description="KL-Cov: coefficient of its |log ratio| penalty.")
    loss_agg_mode: Literal[
        "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = Field("token-mean", description="How per-token losses are aggregated.")
    loss_norm_tokens: int | None = Field(
        None, ge=1, description="Constant divisor of seq-mean-token-sum-norm; null uses max_response_tokens."
    )
    use_kl_loss: bool = Field(False, description="Add a KL-to-reference loss term.")
    kl_loss_coef: float = Field(0.001, ge=0, description="Coefficient of the KL loss term.")
    kl_loss_type: KL_ESTIMATORS = Field(
        "low_var_kl", description="KL estimator of the loss term; a kind with + (k1+, k3+, ...) takes that kind's "
        "value with k2's gradient (straight-through)."
    )
    use_kl_in_reward: bool = Field(False, description="Subtract a KL penalty from token rewards.")
    kl_penalty: Literal["k1", "k2", "k3", "low_var_kl", "abs"] = Field("k1", description="KL estimator of the reward penalty.")
    kl_controller: Literal["fixed", "adaptive"] = Field("fixed", description="Reward KL coefficient controller.")
    kl_coef: float = Field(0.001, ge=0, description="Initial reward KL coefficient.")
    kl_target: float = Field(0.1, gt=0, description="Adaptive controller's target KL.")
    kl_horizon: int = Field(10000, ge=1, description="Adaptive controller's horizon.")
    entropy_coef: float = Field(0.0, description="Entropy bonus coefficient.")
    old_logprobs: Literal["auto", "recompute"] = Field(
        "auto", description="Where the PPO ratio's old logprobs come from. 'recompute': a forward pass of the actor "
        "over the batch before the update. 'auto': the same, except where that pass cannot differ from the update's "
        "own logprobs (colocated mode, one mini-batch, one epoch, no KL penalty in the reward, no decoupled "
        "rollout correction: the weights are those that generated the batch until the update's only optimizer "
        "step); there the update takes its own logprobs, detached, and the pass is skipped. Bypass mode never "
        "runs it: the rollout logprobs are the old ones."
    )
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig, description="Importance weights and rejection for the "
        "rollout/trainer policy gap (TIS: importance_level=token, importance_threshold=2)."
    )
    value_clip: float = Field(0.5, gt=0, description="Critic value clipping range.")

    @model_validator(mode="before")
    @classmethod
    def _tis_cap_moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "tis_cap" in data:
            data = dict(data)
            cap = data.pop("tis_cap")
            if cap is not None:  # a config dumped before the move wrote `tis_cap: null`
                raise ValueError(f"tis_cap is now rollout_correction: set rollout_correction.importance_level=token "
                                 f"and rollout_correction.importance_threshold={cap}")
        return data

    @model_validator(mode="after")
    def _bypass_has_its_own_loss(self) -> AlgorithmConfig:
        if self.rollout_correction.bypass_mode and self.policy_loss != "vanilla":
            raise ValueError(f"rollout_correction.bypass_mode computes its own loss (loss_type="
                             f"{self.rollout_correction.loss_type}); policy_loss must be vanilla, got {self.policy_loss}")
        return self
