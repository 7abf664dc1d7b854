"""Reward scoring. `rlactors.reward.scoring` holds the pure scoring functions (veRL's signature),
bounded in time on any input by `rlactors.reward.limits`; `rlactors.reward.scorer` the Ray scorer
actor, `rlactors.reward.pool` the `RewardPool` of them a driver calls (both imported from there, so
this stays light), `rlactors.reward.worker` the subprocess that runs the functions,
`rlactors.reward.failures` the rule that stops a run whose scoring fails everywhere. Reward models
(`reward.models`): the pool chains their actors after the function scorers, each adding its
weighted part of the reward (`rlactors.reward.parts`): `rlactors.reward.model_scorer` the replica
actor, holding a classifier or sending an LLM judge's messages to its engine (`rlactors.reward.judge`)."""

from rlactors.reward.scoring import (
    check_score,
    compute_arithmetic_score,
    compute_gsm8k_score,
    compute_math_score,
    default_compute_score,
    load_user_function,
    overlong_penalty,
)

__all__ = [
    "check_score",
    "compute_arithmetic_score",
    "compute_gsm8k_score",
    "compute_math_score",
    "default_compute_score",
    "load_user_function",
    "overlong_penalty",
]
