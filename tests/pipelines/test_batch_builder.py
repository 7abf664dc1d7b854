"""`add_advantages` on a multi-turn batch, without Ray: observation tokens take no part."""

import torch

from rlactors.config import AlgorithmConfig
from rlactors.pipelines.batch_builder import add_advantages
from rlactors.trainer.batch import train_batch_from_groups
from rlactors.types import Group, PromptRequest, Sample


def test_the_rollout_trainer_gap_kl_and_advantages_cover_model_tokens_only():
    request = PromptRequest("p", [1, 2])
    mask = [1, 1, 0, 0, 1]
    samples = [Sample("p", k, [1, 2], [3, 4, 5, 6, 7], [-1.0, -1.0, 0.0, 0.0, -1.0], [0] * 5, score=float(k),
                      loss_mask=mask) for k in range(2)]
    batch = train_batch_from_groups([Group(request, samples)])
    # The trainer's logprobs of observation tokens are whatever the model makes of tool output,
    # far from the 0.0 the rollout recorded: they must not show in the gap or the KL penalty.
    old = torch.tensor([-1.0, -1.0, -9.0, -9.0, -1.0])
    rows = [(i, old.clone()) for i in range(2)]
    ref_rows = [(i, old - torch.tensor([0.1, 0.1, 5.0, 5.0, 0.1])) for i in range(2)]
    metrics, kl = add_advantages(batch, rows, ref_rows, None, AlgorithmConfig(advantage="grpo"), kl_coef=1.0)
    assert metrics["rollout/trainer_kl"] == 0.0 and metrics["rollout/logprob_abs_diff_max"] == 0.0
    assert abs(kl - 0.1) < 1e-6
    advantages = batch.token_field("advantages")
    assert all(a[2:4].abs().sum() == 0 and (a[[0, 1, 4]] != 0).all() for a in advantages)
