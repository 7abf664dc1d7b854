"""BatchBuilder: the actor that turns a sampled batch into a TrainBatch with advantages, so that
rollout data never passes through the driver.

    batch = ray.get(builder.assemble.remote(sampled.groups_ref))   # TrainBatchRef: a ref and lengths
    # (no trainer pass before the update: builder.assemble_and_finish(sampled.groups_ref) in one call)
    old = actor.logprob_rows(batch, temperature)                    # one ref per trainer rank
    batch, metrics, current_kl = ray.get(builder.finish.remote(batch.ref, old, ref_rows, value_rows, kl_coef))
    actor.update_policy(batch, temperature)                         # the ranks read batch.ref

The Groups come from the buffer's object, the rows from the trainer ranks' results; the driver
passes their refs and receives lengths and a few metrics. `validation_report` does the same
for scored validation groups (and writes their per-sample parquet file). One actor for the run, on no reserved CPU: its work is list and tensor
bookkeeping. The TrainBatches it puts belong to it and are freed once their refs are dropped.

The numbers are those the driver computed before (the same functions in the same order, in
`add_advantages`): groups in group_id order, old and reference logprobs, token rewards (minus the
KL penalty if `kl_coef` is given), the advantages of `algorithm.advantage`, then the decoupled
rollout correction (importance weights and rejection over the whole batch). All of them run over the
model tokens of the responses (`TrainBatch.train_mask`): a multi-turn response's score lands on its
last model token, and GAE carries values across the observation tokens between turns.
"""

from __future__ import annotations

from pathlib import Path

import ray
import torch

from rlactors import algorithms
from rlactors.config import AlgorithmConfig, RolloutCorrectionConfig
from rlactors.metrics import evaluation
from rlactors.runtime.durable import write_durably
from rlactors.trainer.batch import (
    IMPORTANCE_WEIGHTS,
    LOSS_MASK,
    TrainBatch,
    TrainBatchRef,
    rows_in_batch_order,
    train_batch_from_groups,
)
from rlactors.types import Group


def add_advantages(batch: TrainBatch, old_rows: list[tuple] | None, ref_rows: list[tuple] | None,
                   value_rows: list[tuple] | None, algorithm: AlgorithmConfig, kl_coef: float | None
                   ) -> tuple[dict[str, float], float | None]:
    """Set old/reference logprobs, values, returns and advantages on `batch` from the merged rows of
    the trainers' forward passes (batch order), then the decoupled rollout correction (importance
    weights, rejected tokens out of the loss mask). Returns the metrics and, with `kl_coef` (the KL
    penalty in the reward), the batch's KL for the controller. Without `old_rows` the update takes
    its own logprobs as old ones (`pipelines.common.old_logprobs_from_update`), and measures the
    rollout/trainer gap itself; in bypass mode the rollout logprobs are the old ones."""
    metrics: dict[str, float] = {}
    # Model tokens only: observation tokens (tool or environment output) were not sampled by the
    # policy, so they carry no reward, KL, advantage or rollout/trainer gap (their logprob is 0.0).
    mask = batch.train_mask()
    rollout, _ = batch.padded_field("rollout_logprobs")
    old = rollout if algorithm.rollout_correction.bypass_mode else None
    if old_rows is not None:
        batch.set_field("old_logprobs", [row[1] for row in old_rows])
        # How far the engine's sampling distribution is from the trainer's (precision, kernels, stale
        # weights): the KL estimate E[log p_rollout - log p_trainer] over the sampled tokens.
        old, _ = batch.padded_field("old_logprobs")
        metrics["rollout/trainer_kl"] = float(algorithms.masked_mean(rollout - old, mask))
        metrics["rollout/logprob_abs_diff_max"] = float(((rollout - old).abs() * mask).max()) if mask.any() else 0.0
        metrics["rollout/logprob_abs_diff_mean"] = float(algorithms.masked_mean((rollout - old).abs(), mask))
    token_rewards = algorithms.scores_to_token_rewards(torch.tensor(batch.scores), mask)
    current_kl = None
    if ref_rows is not None:
        batch.set_field("ref_logprobs", [row[1] for row in ref_rows])
        if kl_coef is not None:
            if old is None:
                raise ValueError("a KL penalty in the reward needs the old logprobs of the batch")
            ref, _ = batch.padded_field("ref_logprobs")
            token_rewards, kl = algorithms.apply_kl_in_reward(token_rewards, old, ref, mask, kl_coef,
                                                              algorithm.kl_penalty)
            current_kl = float(kl)
    if algorithm.advantage == "gae":
        batch.set_field("values", [row[1] for row in value_rows])
    advantages, returns = compute_advantages(batch, token_rewards, mask, algorithm)
    if returns is not None:
        batch.set_padded_field("returns", returns)
    batch.set_padded_field("advantages", advantages)
    correction = algorithm.rollout_correction
    if correction.enabled and not correction.bypass_mode:
        if old is None:
            raise ValueError("decoupled rollout correction (algorithm.rollout_correction) needs the old logprobs "
                             "of the batch: run the old-logprob pass")
        metrics |= correct_for_rollout(batch, old, rollout, mask, correction)
    return metrics, current_kl


def compute_advantages(batch: TrainBatch, token_rewards: torch.Tensor, mask: torch.Tensor,
                       algorithm: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(advantages, returns)` of `algorithm.advantage` (returns only where the critic trains on them)."""
    name, group_ids = algorithm.advantage, torch.tensor(batch.group_ids)
    if name == "gae":
        values, _ = batch.padded_field("values")
        return algorithms.gae_advantages(token_rewards, values, mask, algorithm.gamma, algorithm.lam)
    if name == "remax":
        if not batch.baseline_scores:
            raise ValueError("algorithm.advantage=remax needs each group's greedy baseline "
                             "(rollout.sampling.greedy_baseline): the batch has none")
        baselines = torch.tensor(batch.baseline_scores, dtype=token_rewards.dtype)
        return algorithms.remax_advantages(token_rewards, baselines, mask)[0], None
    if name == "reinforce_plus_plus":
        return algorithms.reinforce_plus_plus_advantages(token_rewards, mask, algorithm.gamma)[0], None
    if name == "rloo":
        return algorithms.rloo_advantages(token_rewards, mask, group_ids), None
    if name == "grpo_passk":
        return algorithms.grpo_passk_advantages(token_rewards, mask, group_ids, norm_by_std=algorithm.norm_by_std), None
    if name == "reinforce_plus_plus_baseline":
        return algorithms.reinforce_plus_plus_baseline_advantages(token_rewards, mask, group_ids), None
    if name == "opo":
        return algorithms.opo_advantages(token_rewards, mask, group_ids), None
    if name == "gpg":
        return algorithms.gpg_advantages(token_rewards, mask, group_ids), None
    return algorithms.grpo_advantages(token_rewards, mask, group_ids, norm_by_std=algorithm.norm_by_std), None


def correct_for_rollout(batch: TrainBatch, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
                        correction: RolloutCorrectionConfig) -> dict[str, float]:
    """Decoupled mode, over the whole batch: the `importance_weights` field (the update multiplies
    its policy loss by them) and the rejected tokens taken out of the loss mask (so no loss term and
    no token count sees them). Advantages were computed before: a rejected sample still counted in
    its group's baseline. Returns veRL's `rollout_corr/` metrics."""
    metrics = algorithms.off_policy_metrics(old, rollout, mask)
    if correction.importance_level is not None:
        weights, weight_metrics = algorithms.rollout_importance_weights(
            old, rollout, mask, correction.importance_level, correction.importance_threshold,
            correction.importance_threshold_lower, correction.batch_normalize)
        batch.set_padded_field(IMPORTANCE_WEIGHTS, weights)
        metrics |= weight_metrics
    if correction.rejection is not None:
        options, thresholds = algorithms.parse_rejection(correction.rejection, correction.rejection_threshold)
        kept, rejection_metrics = algorithms.rollout_rejection_mask(old, rollout, mask, options, thresholds)
        loss_masks = batch.loss_masks
        batch.set_field(LOSS_MASK, [m * kept[i, : m.shape[0]] for i, m in enumerate(loss_masks)])
        metrics |= rejection_metrics
    return {f"rollout_corr/{key}": float(value) for key, value in metrics.items()}


def in_group_order(groups: list[Group]) -> TrainBatch:
    """The TrainBatch of `groups` sorted by group_id: the same batch whatever order they finished in."""
    return train_batch_from_groups(sorted(groups, key=lambda g: g.group_id))


def stored(batch: TrainBatch) -> TrainBatchRef:
    return TrainBatchRef.of(ray.put(batch), batch)


@ray.remote(num_cpus=0)
class BatchBuilder:
    def __init__(self, algorithm: AlgorithmConfig, model_path: str | None = None):
        self.algorithm = algorithm
        self.model_path = model_path  # its tokenizer decodes prompts for per-sample reports
        self._tokenizer = None

    def assemble(self, groups: list[Group]) -> TrainBatchRef:
        """The TrainBatch of a sampled batch's Groups (passed as the buffer's ref), in group_id order
        whatever order they finished in."""
        return stored(in_group_order(groups))

    def assemble_and_finish(self, groups: list[Group]) -> tuple[TrainBatchRef, dict[str, float], float | None]:
        """`assemble` and `finish` in one call, for a batch no trainer reads before its update (the
        update takes its own old logprobs; no reference, no critic): one round trip and one stored
        batch fewer, the same numbers."""
        return self.finish(in_group_order(groups), None, None, None, kl_coef=None)

    def finish(self, batch: TrainBatch, old_rows: list, ref_rows: list | None, value_rows: list | None,
               kl_coef: float | None) -> tuple[TrainBatchRef, dict[str, float], float | None]:
        """`add_advantages` with each trainer's per-rank row refs (see `TrainerGroup.logprob_rows`)."""

        def merged(refs: list | None, what: str) -> list[tuple] | None:
            return None if refs is None else rows_in_batch_order(ray.get(refs), len(batch), what)

        metrics, current_kl = add_advantages(batch, merged(old_rows, "actor.compute_logprobs"),
                                             merged(ref_rows, "reference.compute_logprobs"),
                                             merged(value_rows, "critic.compute_values"), self.algorithm, kl_coef)
        return stored(batch), metrics, current_kl

    def validation_report(self, *groups: Group, samples_path: str | None = None) -> dict[str, float]:
        """Accuracy and pass@k per data source of scored groups (`rlactors.metrics.evaluation`); with
        `samples_path`, also one parquet row per response there (prompt, response, score)."""
        if samples_path is not None:
            import pyarrow as pa
            import pyarrow.parquet as pq

            if self._tokenizer is None:
                from rlactors.models import load_tokenizer

                self._tokenizer = load_tokenizer(self.model_path)
            rows = evaluation.sample_rows(groups, lambda ids: self._tokenizer.decode(ids, skip_special_tokens=True))
            sink = pa.BufferOutputStream()
            pq.write_table(pa.Table.from_pylist(rows), sink)
            Path(samples_path).parent.mkdir(parents=True, exist_ok=True)
            write_durably(samples_path, sink.getvalue().to_pybytes())  # a reader never sees half a file
        return evaluation.group_metrics(groups)
