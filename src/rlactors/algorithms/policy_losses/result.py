"""The ending every policy loss but PPO shares, so that each returns the package's contract (see
`rlactors.algorithms.policy_losses`): detached importance weights applied, 0 on padding, and exactly
the three metrics, those veRL does not report set to 0."""

from __future__ import annotations

import torch

from rlactors.algorithms.masked import on_tokens


def policy_loss_result(
    per_token: torch.Tensor,
    valid: torch.Tensor,
    importance_weights: torch.Tensor | None,
    pg_clipfrac: torch.Tensor | None = None,
    pg_clipfrac_lower: torch.Tensor | None = None,
    ppo_kl: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Apply the detached weights, zero the padding and fill the metrics veRL does not report with 0."""
    if importance_weights is not None:
        per_token = per_token * on_tokens(importance_weights.detach(), valid)
    per_token = on_tokens(per_token, valid)
    zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
    values = {"pg_clipfrac": pg_clipfrac, "pg_clipfrac_lower": pg_clipfrac_lower, "ppo_kl": ppo_kl}
    metrics = {name: (zero if value is None else value).detach() for name, value in values.items()}
    return per_token, metrics
