"""The loss mask of multi-turn responses: observation tokens are context, never trained. Pure
functions, no Ray: the batch, its plan, its micro-batches and the losses computed on them."""

import pytest
import torch

from rlactors import algorithms
from rlactors.trainer.batch import (
    LOSS_MASK,
    TrainBatch,
    build_micro_batch,
    train_batch_from_groups,
    unpad_rows,
)
from rlactors.trainer.plan import plan_mini_batches
from rlactors.types import Group, PromptRequest, Sample

# Two turns: 2 model tokens, a 2-token observation, 2 model tokens, a trailing 1-token observation.
MASK = [1, 1, 0, 0, 1, 1, 0]


def _group(prompt_id: str, responses: list[list[int]], masks: list[list[int]]) -> Group:
    request = PromptRequest(prompt_id=prompt_id, prompt_token_ids=[5, 6])
    # Observation tokens carry logprob 0.0, as the rollout records them.
    samples = [Sample(prompt_id, k, [5, 6], response, [0.0 if t < len(mask) and not mask[t] else -0.5
                                                       for t in range(len(response))],
                      [0] * len(response), score=1.0, loss_mask=mask)
               for k, (response, mask) in enumerate(zip(responses, masks, strict=True))]
    return Group(request, samples)


def _batch() -> TrainBatch:
    return train_batch_from_groups([_group("a", [list(range(10, 17)), [20, 21, 22]], [MASK, []])])


def test_the_loss_mask_field_is_set_for_every_sequence():
    batch = _batch()
    assert [m.tolist() for m in batch.token_field(LOSS_MASK)] == [MASK, [1, 1, 1]]
    assert batch.num_model_tokens == [4, 3] and batch.response_lengths == [7, 3]
    _, mask = batch.padded_field("rollout_logprobs")
    assert mask.tolist() == [[bool(m) for m in MASK], [True] * 3 + [False] * 4]


def test_a_batch_without_the_field_trains_every_response_token():
    batch = TrainBatch([[1], [2]], [[3, 4], [5]], [0, 1])
    assert batch.num_model_tokens == [2, 1]
    micro = build_micro_batch(batch, [0, 1])
    assert micro.mask.tolist() == [[True, True], [True, False]]


def test_a_loss_mask_of_the_wrong_length_is_refused_naming_the_sample():
    group = _group("p3", [[1, 2], [3, 4, 5]], [[], [1, 0]])
    with pytest.raises(ValueError, match="p3.*sample_index 1.*loss_mask of 2 entries for 3 response tokens"):
        train_batch_from_groups([group])
    with pytest.raises(ValueError, match="p4.*sample_index 0.*other than 0 and 1"):
        train_batch_from_groups([_group("p4", [[1, 2]], [[1, 2]])])


def test_micro_batch_masks_exclude_observation_tokens_and_rows_keep_every_token():
    batch = _batch()
    micro = build_micro_batch(batch, [1, 0], ("rollout_logprobs",))
    assert micro.mask.tolist() == [[True] * 3 + [False] * 4, [bool(m) for m in MASK]]
    assert micro.num_tokens == 7 and micro.response_lengths == [3, 7]
    rows = unpad_rows(micro.labels.float(), micro.to("cpu"))
    assert [(i, row.tolist()) for i, row in rows] == [(1, [20, 21, 22]), (0, [float(t) for t in range(10, 17)])]
    filler = build_micro_batch(batch, [], ("rollout_logprobs",))
    assert unpad_rows(filler.labels.float(), filler) == [] and filler.num_tokens == 0


def test_the_plan_counts_model_tokens_and_sequences_with_one():
    batch = train_batch_from_groups([_group("a", [[1, 2, 3], [4, 5], [6]], [[1, 0, 1], [0, 0], []])])
    assert batch.num_model_tokens == [2, 0, 1]
    [plan] = plan_mini_batches(batch.sequence_lengths, batch.num_model_tokens, 1, 2, 100)
    assert plan.num_tokens == 3 and plan.num_sequences == 2
    # Packing still pays for every token: the all-observation sequence is planned like the others.
    assert sorted(i for rank in plan.micro_batches for micro in rank for i in micro) == [0, 1, 2]


@pytest.mark.parametrize("mode", algorithms.LOSS_AGG_MODES)
def test_observation_tokens_do_not_change_the_policy_loss(mode):
    """Garbage advantages and old logprobs at observation tokens change nothing; the same garbage at
    a model token does (so the comparison can fail)."""
    generator = torch.Generator().manual_seed(0)

    def loss(batch: TrainBatch) -> torch.Tensor:
        [plan] = plan_mini_batches(batch.sequence_lengths, batch.num_model_tokens, 1, 1, 1000)
        micro = build_micro_batch(batch, plan.micro_batches[0][0], ("advantages", "old_logprobs"))
        logp = torch.linspace(-2.0, -0.1, micro.labels.numel()).reshape(micro.labels.shape)
        per_token, _ = algorithms.ppo_policy_loss(logp, micro.fields["old_logprobs"], micro.fields["advantages"],
                                                  micro.mask)
        return algorithms.aggregate_loss(per_token, micro.mask, mode, plan.num_tokens, plan.num_sequences,
                                         norm_tokens=8)

    def with_fields(advantages, old):
        batch = _batch()
        batch.set_field("advantages", advantages)
        batch.set_field("old_logprobs", old)
        return batch

    lengths = _batch().response_lengths
    advantages = [torch.randn(n, generator=generator) for n in lengths]
    old = [-torch.rand(n, generator=generator) for n in lengths]
    garbage = [a.clone() for a in advantages]
    garbage_old = [o.clone() for o in old]
    observation = torch.tensor(MASK) == 0
    garbage[0][observation] = 1e6
    garbage_old[0][observation] = -50.0
    clean = loss(with_fields(advantages, old))
    torch.testing.assert_close(loss(with_fields(garbage, garbage_old)), clean, rtol=0, atol=0)
    at_a_model_token = [a.clone() for a in advantages]
    at_a_model_token[0][0] = 1e6
    assert not torch.isclose(loss(with_fields(at_a_model_token, old)), clean)


def test_the_score_lands_on_the_last_model_token_and_gae_skips_observations():
    batch = _batch()
    mask = batch.train_mask()
    rewards = algorithms.scores_to_token_rewards(torch.tensor([2.0, 3.0]), mask)
    assert rewards[0].tolist() == [0, 0, 0, 0, 0, 2.0, 0] and rewards[1].tolist() == [0, 0, 3.0, 0, 0, 0, 0]
    # GAE over the interleaved response equals GAE over the model tokens alone, laid side by side:
    # observation positions carry the next value and the running advantage through.
    values = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3))
    advantages, returns = algorithms.gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    model = torch.tensor(MASK) == 1
    compact_values = torch.stack([values[0][model], values[1][:4]])
    compact_mask = torch.tensor([[True] * 4, [True] * 3 + [False]])
    compact_rewards = algorithms.scores_to_token_rewards(torch.tensor([2.0, 3.0]), compact_mask)
    expected, expected_returns = algorithms.gae_advantages(compact_rewards, compact_values, compact_mask, 0.9, 0.8)
    torch.testing.assert_close(advantages[0][model], expected[0])
    torch.testing.assert_close(returns[0][model], expected_returns[0])
    assert advantages[0][~model].abs().sum() == 0  # nothing to train at observations
