import math

import pytest
import torch

from rlactors.algorithms import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    adaptive_kl_coef,
    apply_kl_in_reward,
    kl_penalty,
)

LOGP = torch.tensor([[-1.0, 0.0, 0.0, -50.0]])
REF = torch.tensor([[-2.0, -100.0, 0.0, 0.0]])


def test_each_estimator_by_hand():
    assert kl_penalty(LOGP, REF, "k1").tolist() == [[1.0, 100.0, 0.0, -50.0]]
    assert kl_penalty(LOGP, REF, "abs").tolist() == [[1.0, 100.0, 0.0, 50.0]]
    assert kl_penalty(LOGP, REF, "k2").tolist() == [[0.5, 5000.0, 0.0, 1250.0]]
    low_var = kl_penalty(LOGP, REF, "k3")
    # x = ref - logp: -1 -> e^-1 + 1 - 1; -100 clamps to -20 -> e^-20 + 19, then clamps to 10;
    # 0 -> 0; +50 clamps to 20 -> e^20 - 21, then clamps to 10.
    assert torch.allclose(low_var, torch.tensor([[math.exp(-1.0), 10.0, 0.0, 10.0]]))


def test_aliases_and_unknown_kind():
    for alias, name in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
        assert torch.equal(kl_penalty(LOGP, REF, alias), kl_penalty(LOGP, REF, name))
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(LOGP, REF, "full")


def _verl_straight_through(logprob, ref_logprob, kind):
    # veRL 0.9.1's `kl_penalty` for a kind ending in "+": the forward estimator of the kind without it.
    forward_score = kl_penalty(logprob, ref_logprob, kind[:-1])
    backward_score = 0.5 * (logprob - ref_logprob).square()
    return backward_score - backward_score.detach() + forward_score.detach()


@pytest.mark.parametrize(("kind", "base"), [("k1+", "k1"), ("kl+", "k1"), ("k3+", "k3"), ("low_var_kl+", "k3"),
                                            ("abs+", "abs"), ("k2+", "k2")])
def test_straight_through_kinds_have_the_value_of_their_kind_and_the_gradient_of_k2(kind, base):
    logp = torch.tensor([[-1.0, -3.0, 0.0, -50.0]], dtype=torch.float64, requires_grad=True)
    ref = REF.to(torch.float64)
    value = kl_penalty(logp, ref, kind)
    assert kind in KL_KINDS
    assert torch.equal(value, kl_penalty(logp, ref, base))
    (grad,) = torch.autograd.grad(value.sum(), logp)
    # k2 = 0.5 (logp - ref)^2 -> gradient logp - ref: [1, 97, 0, -50]
    assert torch.equal(grad, torch.tensor([[1.0, 97.0, 0.0, -50.0]], dtype=torch.float64))
    expected = _verl_straight_through(logp, ref, kind)
    (expected_grad,) = torch.autograd.grad(expected.sum(), logp)
    assert torch.equal(value, expected) and torch.equal(grad, expected_grad)


def test_low_var_kl_gradient_and_dtype():
    logp = torch.tensor([-1.0, -3.0], requires_grad=True)
    ref = torch.tensor([-2.0, -1.0])
    kl_penalty(logp, ref, "k3").sum().backward()
    # d/dlogp of exp(ref - logp) - (ref - logp) - 1 = 1 - exp(ref - logp)
    assert torch.allclose(logp.grad, torch.tensor([1 - math.exp(-1.0), 1 - math.exp(2.0)]))
    assert kl_penalty(logp.detach().to(torch.bfloat16), ref.to(torch.bfloat16), "k3").dtype == torch.bfloat16


def test_kl_in_reward_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, float("-inf")]])
    ref = torch.tensor([[-1.5, -1.0, -0.8], [-2.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    new_rewards, current_kl = apply_kl_in_reward(rewards, logp, ref, mask, kl_coef=0.1, kind="k1")
    # k1 per token: row 0 [0.5, 0, -0.2], row 1 [1, 0, padding]
    assert torch.allclose(new_rewards, torch.tensor([[-0.05, 0.0, 1.02], [-0.1, 1.0, 0.0]]))
    # current KL: mean over sequences of each sequence's token mean.
    assert math.isclose(current_kl.item(), ((0.5 + 0 - 0.2) / 3 + (1 + 0) / 2) / 2, rel_tol=1e-6)
    _, empty_kl = apply_kl_in_reward(rewards, logp, ref, torch.zeros_like(mask), 0.1)
    assert empty_kl.item() == 0.0


def test_adaptive_coefficient_by_hand():
    # KL above target: error clipped to +0.2, mult = 1 + 0.2 * 100 / 1000.
    assert math.isclose(adaptive_kl_coef(0.1, 0.15, 0.1, 100, 1000), 0.1 * 1.02)
    # KL below target: error -0.1, mult = 1 - 0.1 * 100 / 1000.
    assert math.isclose(adaptive_kl_coef(0.1, 0.09, 0.1, 100, 1000), 0.1 * 0.99)
    assert math.isclose(adaptive_kl_coef(0.1, 0.0, 0.1, 500, 1000), 0.1 * 0.9)


def test_controllers_update_and_round_trip_their_state():
    controller = AdaptiveKLController(init_coef=0.1, target=0.1, horizon=1000)
    controller.update(current_kl=torch.tensor(0.15), num_steps=100)
    assert math.isclose(controller.value, 0.102)
    restored = AdaptiveKLController(init_coef=0.5, target=1.0, horizon=1)
    restored.load_state_dict(controller.state_dict())
    for kl in (0.3, 0.05, 0.12):
        controller.update(kl, 64)
        restored.update(kl, 64)
    assert restored.value == controller.value and restored.state_dict() == controller.state_dict()

    fixed = FixedKLController(0.2)
    fixed.update(5.0, 100)
    assert fixed.value == 0.2
    other = FixedKLController(0.0)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.2
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
