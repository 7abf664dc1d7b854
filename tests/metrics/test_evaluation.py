"""Validation and evaluation numbers (`rlactors.metrics.evaluation`): pass@k against hand-computed cases and
the brute-force probability it estimates, and the per-source metrics."""

import itertools
import math

import pytest

from rlactors.metrics.evaluation import k_values, pass_at_k, sample_rows, validation_metrics
from rlactors.types import Group, PromptRequest, Sample


def test_pass_at_k_hand_computed():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)
    assert pass_at_k(4, 3, 2) == 1.0  # fewer wrong answers than draws: a correct one is always drawn


@pytest.mark.parametrize("num_samples", [1, 2, 5, 8])
def test_pass_at_k_is_the_chance_that_k_draws_hold_a_correct_one(num_samples):
    for num_correct in range(num_samples + 1):
        correct = [i < num_correct for i in range(num_samples)]
        for k in range(1, num_samples + 1):
            draws = list(itertools.combinations(correct, k))
            expected = sum(any(draw) for draw in draws) / len(draws)
            assert pass_at_k(num_samples, num_correct, k) == pytest.approx(expected, abs=1e-12)
        # No correct response: zero at every k; pass@1 is the share correct.
        assert pass_at_k(num_samples, 0, num_samples) == 0.0
        assert pass_at_k(num_samples, num_correct, 1) == pytest.approx(num_correct / num_samples)


def test_pass_at_k_refuses_impossible_counts():
    for args in [(4, 1, 0), (4, 1, 5), (4, 5, 1), (4, -1, 1)]:
        with pytest.raises(ValueError, match="pass@"):
            pass_at_k(*args)


def test_k_values():
    assert k_values(1) == [1]
    assert k_values(6) == [1, 2, 4, 6]
    assert k_values(8) == [1, 2, 4, 8]


def test_metrics_per_source_greedy_and_sampled():
    greedy = validation_metrics([("gsm8k", [1.0]), ("gsm8k", [0.0]), ("math", [1.0])])
    assert greedy == {"gsm8k/acc": 0.5, "math/acc": 1.0}  # one response per prompt: acc is pass@1
    sampled = validation_metrics([("gsm8k", [1, 0, 0, 0]), ("gsm8k", [0, 0, 0, 0]), ("math", [1, 1])])
    assert sampled["gsm8k/acc"] == pytest.approx(1 / 8)  # mean@4 over every response
    assert sampled["gsm8k/pass@1"] == pytest.approx(sampled["gsm8k/acc"])
    assert sampled["gsm8k/pass@2"] == pytest.approx((0.5 + 0.0) / 2)
    assert sampled["gsm8k/pass@4"] == pytest.approx(0.5)
    assert sampled["math/pass@2"] == 1.0 and "math/pass@4" not in sampled
    # Prompts of one source with different numbers of responses: the k every prompt allows.
    uneven = validation_metrics([("s", [1, 0, 0, 0]), ("s", [0, 1])])
    assert sorted(uneven) == ["s/acc", "s/pass@1", "s/pass@2"]
    assert all(not math.isnan(v) for v in uneven.values())


def test_sample_rows_keep_text_and_errors():
    request = PromptRequest("p1", [3, 4], data_source="synthetic/arithmetic", ground_truth="7")
    samples = [Sample("p1", 0, [3, 4], [5], [-0.5], [0], text="7", score=1.0, score_details={"acc": 1.0}),
               Sample("p1", 1, [3, 4], [6], [-0.5], [0], text="8", score=None, score_error="reward raised: boom")]
    rows = sample_rows([Group(request, samples)], lambda ids: "".join(map(str, ids)))
    assert [(r["prompt"], r["response"], r["acc"], r["error"]) for r in rows] == [
        ("34", "7", 1.0, None), ("34", "8", 0.0, "reward raised: boom")]
    assert all(r["prompt_id"] == "p1" and r["ground_truth"] == "7" for r in rows)
