"""Masked reductions and selections over response tokens.

A mask is a [batch, response_len] tensor (bool, int or float) that is 1 on response tokens and 0 on
padding; `valid` is the bool form, `mask != 0`. Padded positions may hold anything, even inf or NaN
(a pad token's logprob can be -inf): every reduction and selection here selects with `torch.where`
before any arithmetic, so they never leak into results (`masked_whiten` transforms padding too).
Results keep the dtype of `x`.
"""

from __future__ import annotations

import math

import torch

# veRL's constants, kept so that results compare across frameworks.
MEAN_EPS = 1e-8
WHITEN_EPS = 1e-8
# The bound on a log ratio of two policies' probabilities before it is exponentiated, wherever one is
# (veRL's SAFETY_BOUND): exp(20) ~ 5e8 bounds the ratio when the policies drift apart.
LOG_RATIO_CLAMP = 20.0


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x * mask` (over all elements, or along `dim`), ignoring whatever padding holds."""
    mask = mask.to(x.dtype)
    selected = torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device)) * mask
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """`sum(x * mask) / (sum(mask) + 1e-8)`, over all elements or along `dim`.

    An all-zero mask gives 0, not NaN.
    """
    mask = mask.to(x.dtype)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / (count + MEAN_EPS)


def masked_fraction(condition: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fraction of response tokens where the bool `condition` holds, in `dtype` (0 for an empty mask)."""
    return masked_mean(condition.to(dtype), mask)


def masked_max(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Maximum of the selected elements of `x` (over all, or along `dim`); -inf where none is selected."""
    selected = torch.where(mask != 0, x, torch.full_like(x, -math.inf))
    return selected.max() if dim is None else selected.max(dim=dim).values


def masked_min(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Minimum of the selected elements of `x` (over all, or along `dim`); inf where none is selected."""
    selected = torch.where(mask != 0, x, torch.full_like(x, math.inf))
    return selected.min() if dim is None else selected.min(dim=dim).values


def on_tokens(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`x` on response tokens and 0 on padding (`valid` is bool): selected, not multiplied, so -inf
    or NaN on padding reaches neither the result nor the gradient."""
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))


def zero_padding(valid: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each of `tensors` with 0 on padding (`on_tokens`), so that arithmetic on them stays finite."""
    return [on_tokens(tensor, valid) for tensor in tensors]


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the selected elements of `x` (a scalar), with Bessel's correction by default.

    Deviation from veRL: veRL raises when fewer than two elements are selected; here the correction
    is skipped in that case, so the variance is 0 (there is nothing to spread) and callers never see
    NaN or an exception on an empty micro-batch.
    """
    mean = masked_mean(x, mask)
    variance = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = mask.to(x.dtype).sum()
        variance = variance * count / (count - 1).clamp(min=1)
    return variance


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """`(x - mean) * rsqrt(var + 1e-8)` with the masked mean and unbiased masked variance.

    With `shift_mean=False` the mean is added back (only the scale changes), as in veRL. Padded
    positions are transformed too (veRL does the same); losses mask them out.
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
