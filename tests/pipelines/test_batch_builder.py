"""`add_advantages` without Ray: every estimator by its name, ReMax's baselines, the decoupled rollout
correction, and a multi-turn batch (observation tokens take no part)."""

import math
import pickle

import pytest
import torch

from rlactors import algorithms
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
    assert metrics["rollout/logprob_abs_diff_mean"] == 0.0
    assert abs(kl - 0.1) < 1e-6
    advantages = batch.token_field("advantages")
    assert all(a[2:4].abs().sum() == 0 and (a[[0, 1, 4]] != 0).all() for a in advantages)


def _groups(num_groups=2, num_samples=3, with_baseline=False):
    groups = []
    for g in range(num_groups):
        request = PromptRequest(f"p{g}", [1, 2], group_id=f"p{g}#0")
        samples = [Sample(f"p{g}", k, [1, 2], [3, 4, 5][: 1 + k], [-1.0 - 0.1 * k] * (1 + k), [0] * (1 + k),
                          score=float((g + k) % 2) + 0.25 * k) for k in range(num_samples)]
        baseline = Sample(f"p{g}", num_samples, [1, 2], [3], [-0.5], [0], score=0.5 * g) if with_baseline else None
        groups.append(Group(request, samples, baseline))
    return groups


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo",
                                       "gpg", "grpo_passk", "remax"])
def test_every_advantage_estimator_is_reached_by_its_config_name(advantage):
    """Each name reaches its own function: the advantages equal that function's on the batch."""
    batch = train_batch_from_groups(_groups(with_baseline=advantage == "remax"))
    add_advantages(batch, None, None, None, AlgorithmConfig(advantage=advantage, gamma=0.9), kl_coef=None)
    got, mask = batch.padded_field("advantages")
    rewards = algorithms.scores_to_token_rewards(torch.tensor(batch.scores), mask)
    group_ids = torch.tensor(batch.group_ids)
    expected = {
        "grpo": lambda: algorithms.grpo_advantages(rewards, mask, group_ids),
        "rloo": lambda: algorithms.rloo_advantages(rewards, mask, group_ids),
        "reinforce_plus_plus": lambda: algorithms.reinforce_plus_plus_advantages(rewards, mask, 0.9)[0],
        "reinforce_plus_plus_baseline": lambda: algorithms.reinforce_plus_plus_baseline_advantages(rewards, mask,
                                                                                                   group_ids),
        "opo": lambda: algorithms.opo_advantages(rewards, mask, group_ids),
        "gpg": lambda: algorithms.gpg_advantages(rewards, mask, group_ids),
        "grpo_passk": lambda: algorithms.grpo_passk_advantages(rewards, mask, group_ids),
        "remax": lambda: algorithms.remax_advantages(rewards, torch.tensor([0.0] * 3 + [0.5] * 3), mask)[0],
    }[advantage]()
    torch.testing.assert_close(got, expected.float())
    assert got.abs().sum() > 0


def test_remax_takes_each_group_s_greedy_score_and_refuses_a_batch_without_one():
    batch = train_batch_from_groups(_groups(with_baseline=True))
    assert batch.baseline_scores == [0.0] * 3 + [0.5] * 3
    assert pickle.loads(pickle.dumps(batch)).baseline_scores == batch.baseline_scores
    assert batch.select([5, 0]).baseline_scores == [0.5, 0.0]
    add_advantages(batch, None, None, None, AlgorithmConfig(advantage="remax"), kl_coef=None)
    advantages = batch.token_field("advantages")
    differences = [s - b for s, b in zip(batch.scores, batch.baseline_scores, strict=True)]
    assert [float(a[-1]) for a in advantages] == pytest.approx(differences)
    with pytest.raises(ValueError, match="needs each group's greedy baseline"):
        add_advantages(train_batch_from_groups(_groups()), None, None, None, AlgorithmConfig(advantage="remax"), None)
    mixed = _groups(with_baseline=True)
    mixed[1].baseline = None
    with pytest.raises(ValueError, match=r"groups \['p1#0'\] have no greedy baseline"):
        train_batch_from_groups(mixed)


def test_decoupled_correction_weights_the_batch_and_takes_rejected_tokens_out_of_the_loss_mask():
    batch = train_batch_from_groups(_groups(num_groups=2, num_samples=3))
    rollout, mask = batch.padded_field("rollout_logprobs")
    # Old logprobs 1.0 above the rollout's on every token of sample 2 of each group: weight e > 2.
    shift = torch.tensor([[0.0], [0.1], [1.0]] * 2)
    rows = [(i, (rollout[i] + shift[i])[: n]) for i, n in enumerate(batch.response_lengths)]
    correction = dict(importance_level="token", importance_threshold=2.0, rejection="token_k1",
                      rejection_threshold="0.5_2.0")
    algorithm = AlgorithmConfig(rollout_correction=correction)
    metrics, _ = add_advantages(batch, rows, None, None, algorithm, kl_coef=None)
    weights = batch.token_field("importance_weights")
    assert torch.cat(weights[:3]).tolist() == pytest.approx([1.0] + [math.exp(0.1)] * 2 + [2.0] * 3)
    # k1 = rollout - old = -1.0 < log(0.5): the whole of sample 2 leaves the loss, the others stay.
    assert [m.tolist() for m in batch.loss_masks[:3]] == [[1.0], [1.0, 1.0], [0.0, 0.0, 0.0]]
    assert batch.num_model_tokens == [1, 2, 0] * 2
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(2.0)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(6 / 12)
    assert all(key.startswith(("rollout/", "rollout_corr/")) for key in metrics)
    with pytest.raises(ValueError, match="needs the old logprobs"):
        add_advantages(train_batch_from_groups(_groups()), None, None, None, algorithm, kl_coef=None)
