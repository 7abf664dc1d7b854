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
KL penalty if `kl_coef` is given), then GAE, RLOO or GRPO advantages. All of them run over the
model tokens of the responses (`TrainBatch.train_mask`): a multi-turn response's score lands on its
last model token, and GAE carries values across the observation tokens between turns.
"""

from __future__ import annotations

from pathlib import Path

import ray
import torch

from rlactors import algorithms, evaluation
from rlactors.config import AlgorithmConfig
from rlactors.durable import write_durably
from rlactors.trainer.batch import (
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
    the trainers' forward passes (batch order). Returns the metrics and, with `kl_coef` (the KL
    penalty in the reward), the batch's KL for the controller. Without `old_rows` the update takes
    its own logprobs as old ones (`pipelines.common.old_logprobs_from_update`), and measures the
    rollout/trainer gap itself."""
    metrics: dict[str, float] = {}
    # Model tokens only: observation tokens (tool or environment output) were not sampled by the
    # policy, so they carry no reward, KL, advantage or rollout/trainer gap (their logprob is 0.0).
    mask = batch.train_mask()
    old = None
    if old_rows is not None:
        batch.set_field("old_logprobs", [row[1] for row in old_rows])
        # How far the engine's sampling distribution is from the trainer's (precision, kernels, stale
        # weights): the KL estimate E[log p_rollout - log p_trainer] over the sampled tokens.
        rollout, _ = batch.padded_field("rollout_logprobs")
        old, _ = batch.padded_field("old_logprobs")
        metrics["rollout/trainer_kl"] = float(algorithms.masked_mean(rollout - old, mask))
        metrics["rollout/logprob_abs_diff_max"] = float(((rollout - old).abs() * mask).max()) if mask.any() else 0.0
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
    group_ids = torch.tensor(batch.group_ids)
    if algorithm.advantage == "gae":
        batch.set_field("values", [row[1] for row in value_rows])
        values, _ = batch.padded_field("values")
        advantages, returns = algorithms.gae_advantages(token_rewards, values, mask, algorithm.gamma, algorithm.lam)
        batch.set_padded_field("returns", returns)
    elif algorithm.advantage == "rloo":
        advantages = algorithms.rloo_advantages(token_rewards, mask, group_ids)
    else:
        advantages = algorithms.grpo_advantages(token_rewards, mask, group_ids, norm_by_std=algorithm.norm_by_std)
    batch.set_padded_field("advantages", advantages)
    return metrics, current_kl


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
        """Accuracy and pass@k per data source of scored groups (`rlactors.evaluation`); with
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
