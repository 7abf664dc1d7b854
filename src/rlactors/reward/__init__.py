"""Reward scoring. `rlactors.reward.scoring` holds the pure scoring functions (veRL's signature);
`rlactors.reward.scorer` the Ray scorer actor and `RewardPool` (imported there, so this stays light)."""

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
