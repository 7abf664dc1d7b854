import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlactors.algorithms import LOSS_AGG_MODES, aggregate_loss, num_nonempty_sequences

INF = float("inf")
LOSS = torch.tensor([[1.0, 2.0, INF], [4.0, float("nan"), 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # 3 tokens; the third sequence is empty


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("token-sum", 1 + 2 + 4),
        ("seq-mean-token-sum", ((1 + 2) + 4) / 2),  # the empty sequence does not count
        ("seq-mean-token-mean", ((1 + 2) / 2 + 4 / 1) / 2),
        ("seq-mean-token-sum-norm", ((1 + 2) / 4 + 4 / 4) / 2),  # norm_tokens=4
    ],
)
def test_each_mode_by_hand(mode, expected):
    loss = aggregate_loss(LOSS, MASK, mode, norm_tokens=4)
    assert math.isclose(loss.item(), expected, rel_tol=1e-6)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 10),
        ("token-sum", 7),  # global counts do not apply to a plain sum
        ("seq-mean-token-sum", 7 / 5),
        ("seq-mean-token-mean", 5.5 / 5),
        ("seq-mean-token-sum-norm", 1.75 / 5),
    ],
)
def test_explicit_global_counts_are_used(mode, expected):
    loss = aggregate_loss(LOSS, MASK, mode, global_num_tokens=10, global_num_sequences=torch.tensor(5), norm_tokens=4)
    assert math.isclose(loss.item(), expected, rel_tol=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_all_zero_mask_gives_zero_loss_and_zero_gradient(mode):
    weights = torch.ones(2, 3, requires_grad=True)
    loss = aggregate_loss(weights * 5.0, torch.zeros(2, 3), mode, norm_tokens=3)
    loss.backward()
    assert loss.item() == 0.0
    assert weights.grad.abs().sum().item() == 0.0


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="norm_tokens"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        aggregate_loss(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match="same shape"):
        aggregate_loss(LOSS, MASK[:, :2], "token-mean")


def test_dtype_is_preserved():
    for dtype in (torch.float64, torch.bfloat16):
        for mode in LOSS_AGG_MODES:
            assert aggregate_loss(torch.ones(2, 3, dtype=dtype), MASK[:2], mode, norm_tokens=3).dtype == dtype


def _batch(lengths, width, seed):
    generator = torch.Generator().manual_seed(seed)
    mask = (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(-1)).float()
    features = torch.randn(len(lengths), width, generator=generator)
    return features, mask


def _per_token_loss(params, features):
    # A loss that depends non-linearly on the parameters, so gradients are a real check.
    return torch.tanh(features * params[0]) * params[1] + params[2] * features**2


def _split_loss_and_grad(features, mask, mode, bounds, norm_tokens):
    """Sum of micro-batch losses (each micro-batch trimmed to its own padded width) and its gradient."""
    params = torch.tensor([0.7, -1.3, 0.4], dtype=features.dtype, requires_grad=True)
    counts = {"global_num_tokens": mask.sum(), "global_num_sequences": num_nonempty_sequences(mask)}
    if len(bounds) == 2:  # the whole batch: the defaults must already be the global counts
        counts = {}
    total = torch.zeros((), dtype=features.dtype)
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        micro_mask = mask[start:stop]
        width = max(1, int(micro_mask.sum(dim=-1).max().item()))  # the trainer pads per micro-batch
        micro_loss = _per_token_loss(params, features[start:stop, :width])
        loss = aggregate_loss(micro_loss, micro_mask[:, :width], mode, norm_tokens=norm_tokens, **counts)
        loss.backward()  # accumulate, as a trainer does
        total = total + loss.detach()
    return total, params.grad


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_one_or_four_micro_batches_give_the_same_loss_and_gradient(mode):
    lengths = [5, 1, 0, 3, 7, 2, 7, 4]  # includes an empty sequence
    features, mask = _batch(lengths, width=7, seed=0)
    features = features.double()
    full_loss, full_grad = _split_loss_and_grad(features, mask, mode, [0, 8], norm_tokens=8)
    split_loss, split_grad = _split_loss_and_grad(features, mask, mode, [0, 2, 4, 6, 8], norm_tokens=8)
    assert torch.allclose(full_loss, split_loss, rtol=1e-12)
    assert torch.allclose(full_grad, split_grad, rtol=1e-12)
    # And the whole-batch value is the mode's definition, computed with loops.
    token_losses = _per_token_loss(torch.tensor([0.7, -1.3, 0.4], dtype=torch.float64), features)
    rows = [[token_losses[i, t].item() for t in range(n)] for i, n in enumerate(lengths)]
    nonempty = [row for row in rows if row]
    expected = {
        "token-mean": sum(map(sum, rows)) / sum(lengths),
        "token-sum": sum(map(sum, rows)),
        "seq-mean-token-sum": sum(map(sum, nonempty)) / len(nonempty),
        "seq-mean-token-mean": sum(sum(row) / (len(row) + 1e-8) for row in nonempty) / len(nonempty),  # veRL eps
        "seq-mean-token-sum-norm": sum(sum(row) / 8 for row in nonempty) / len(nonempty),
    }[mode]
    assert math.isclose(full_loss.item(), expected, rel_tol=1e-9)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(0, 6), min_size=1, max_size=10),
    st.lists(st.integers(1, 9), min_size=1, max_size=4),
    st.sampled_from(LOSS_AGG_MODES),
)
def test_any_split_sums_to_the_full_batch_loss(lengths, cut_points, mode):
    features, mask = _batch(lengths, width=6, seed=len(lengths))
    features = features.double()
    cuts = sorted({c for c in cut_points if c < len(lengths)})
    bounds = [0, *cuts, len(lengths)]
    full_loss, full_grad = _split_loss_and_grad(features, mask, mode, [0, len(lengths)], norm_tokens=6)
    split_loss, split_grad = _split_loss_and_grad(features, mask, mode, bounds, norm_tokens=6)
    assert torch.allclose(full_loss, split_loss, rtol=1e-10, atol=1e-12)
    assert torch.allclose(full_grad, split_grad, rtol=1e-10, atol=1e-12)


def test_bradley_terry_loss_by_hand_and_split_into_pairs_of_micro_batches():
    """-log sigmoid(chosen - rejected), averaged over the pairs of the whole mini-batch: two calls on
    halves, each given the global pair count, sum to one call on all pairs, gradients included."""
    from rlactors.algorithms import bradley_terry_loss

    chosen = torch.tensor([2.0, 0.0, -1.0, 0.5], requires_grad=True)
    rejected = torch.tensor([1.0, 0.0, 1.0, -0.5], requires_grad=True)
    loss, metrics = bradley_terry_loss(chosen, rejected)
    expected = sum(math.log1p(math.exp(-m)) for m in (1.0, 0.0, -2.0, 1.0)) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert float(metrics["preference_accuracy"]) == 2 and float(metrics["score_margin"]) == pytest.approx(0.0)
    loss.backward()
    whole = chosen.grad.clone()
    assert (whole < 0).all() and torch.equal(rejected.grad, -whole)  # raising chosen, lowering rejected, lowers it
    chosen.grad = None
    halves = sum(bradley_terry_loss(chosen[i:i + 2], rejected[i:i + 2], global_num_pairs=4)[0] for i in (0, 2))
    assert halves.item() == pytest.approx(expected, rel=1e-6)
    halves.backward()
    torch.testing.assert_close(chosen.grad, whole)
    with pytest.raises(ValueError, match="1-D and alike"):
        bradley_terry_loss(torch.zeros(3), torch.zeros(2))
