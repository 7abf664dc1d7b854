"""Reward scoring throughput: the scorer pool vs the same scorer called in a plain loop.

    .venv/bin/python benchmarks/reward_throughput.py --num-samples 10000 --num-workers 2

Scores seeded MATH-style responses (`\\boxed{\\frac{3}{4}}` answers in several equivalent forms,
about half of them right) with `default_compute_score`, first in a loop in this process, then
through `RewardPool` with the groups passed as object refs. Both sides are warmed up first
(sympy import, worker start). Prints one final JSON line: samples_per_s (pool),
baseline_samples_per_s (loop), ratio, and whether both gave the same score to every sample.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from fractions import Fraction

import ray

from rlactors.config import RewardConfig
from rlactors.reward.pool import RewardPool
from rlactors.reward.scoring import default_compute_score
from rlactors.types import Group, PromptRequest, Sample

DATA_SOURCE = "synthetic/math"


def latex(value: Fraction) -> str:
    return (
        str(value.numerator)
        if value.denominator == 1
        else f"\\frac{{{value.numerator}}}{{{value.denominator}}}"
    )


def response_for(gold: Fraction, rng: random.Random) -> str:
    """A short worked answer; right in one of several forms, or wrong, or with no final answer."""
    kind = rng.random()
    if kind < 0.5:
        k = rng.randint(1, 4)
        forms = [
            latex(gold),
            f"\\dfrac{{{gold.numerator * k}}}{{{gold.denominator * k}}}",
            f"{gold.numerator}/{gold.denominator}",
        ]
        if 1000 % gold.denominator == 0:
            forms.append(f"{float(gold):g}")
        answer = rng.choice(forms)
    elif kind < 0.9:
        answer = latex(rng.choice([gold + 1, 1 / gold if gold else Fraction(2), gold * 2, -gold]))
    else:
        return f"We simplify {gold.denominator * 2} terms and get stuck."
    steps = " ".join(
        f"Step {i}: combine terms {rng.randint(1, 99)} and {rng.randint(1, 99)}." for i in range(4)
    )
    return f"{steps} Therefore the answer is $\\boxed{{{answer}}}$."


def make_groups(num_samples: int, samples_per_group: int, seed: int) -> list[Group]:
    rng = random.Random(seed)
    groups = []
    for prompt_index in range(-(-num_samples // samples_per_group)):
        gold = Fraction(rng.randint(1, 200), rng.randint(1, 60))
        prompt_id = f"bench-{prompt_index}"
        request = PromptRequest(prompt_id, [0], data_source=DATA_SOURCE, ground_truth=latex(gold))
        num = min(samples_per_group, num_samples - prompt_index * samples_per_group)
        samples = []
        for i in range(num):
            text = response_for(gold, rng)
            samples.append(Sample(prompt_id, i, [0], response_token_ids=[0] * (len(text) // 4), text=text))
        groups.append(Group(request, samples))
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-samples", type=int, default=10_000)
    parser.add_argument("--samples-per-group", type=int, default=8)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--max-groups-per-call", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    groups = make_groups(args.num_samples, args.samples_per_group, args.seed)
    num_samples = sum(len(g.samples) for g in groups)

    default_compute_score(DATA_SOURCE, "\\boxed{1}", "1")  # warm-up: imports sympy and math-verify
    start = time.perf_counter()
    baseline = [
        default_compute_score(DATA_SOURCE, s.text, g.request.ground_truth)["score"]
        for g in groups
        for s in g.samples
    ]
    baseline_s = time.perf_counter() - start

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = RewardConfig(num_workers=args.num_workers, max_groups_per_call=args.max_groups_per_call)
    pool = RewardPool(config)
    ray.get(pool.score_many(groups[: args.num_workers]))  # warm-up: every worker imports sympy
    group_refs = [ray.put(g) for g in groups]  # as a rollout engine would hand them over
    start = time.perf_counter()
    scored = ray.get(pool.score_many(group_refs))
    pool_s = time.perf_counter() - start
    metrics = pool.metrics()
    pool.shutdown()
    ray.shutdown()

    pool_scores = [s.score for g in scored for s in g.samples]
    result = {
        "num_samples": num_samples,
        "num_workers": args.num_workers,
        "max_groups_per_call": args.max_groups_per_call,
        "accuracy": round(sum(baseline) / num_samples, 4),
        "scores_match": pool_scores == baseline,
        "num_errors": int(metrics["reward/num_errors"]),
        "num_timeouts": int(metrics["reward/num_timeouts"]),
        "baseline_samples_per_s": round(num_samples / baseline_s, 1),
        "samples_per_s": round(num_samples / pool_s, 1),
        "ratio": round(baseline_s / pool_s, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
