"""Plain functions the rollout engine and router share: checking a prompt and its sampling settings,
per-sample seeds, the Group that reports a failed request, and per-token policy versions."""

from __future__ import annotations

import zlib

from rlactors.config import SamplingConfig
from rlactors.types import Group, PromptRequest, Sample

SamplingArg = SamplingConfig | dict | None


def resolve_sampling(sampling: SamplingArg, default: SamplingConfig) -> SamplingConfig:
    """A SamplingConfig from a config, a dict of fields, or None (the default)."""
    if sampling is None:
        return default
    if isinstance(sampling, SamplingConfig):
        return sampling
    return SamplingConfig.model_validate(sampling)


def check_prompt(request: PromptRequest, vocab_size: int, max_model_len: int) -> None:
    """Raise ValueError naming the prompt_id if the prompt cannot be answered."""
    tokens = request.prompt_token_ids
    if not tokens:
        raise ValueError(f"prompt_id={request.prompt_id!r}: empty prompt")
    bad = [t for t in tokens if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_id={request.prompt_id!r}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if len(tokens) >= max_model_len:
        raise ValueError(
            f"prompt_id={request.prompt_id!r}: prompt has {len(tokens)} tokens but the context "
            f"(max_model_len) is {max_model_len}, leaving no room for a response"
        )


def sample_seed(seed: int | None, group_id: str, sample_index: int, num_tokens_done: int) -> int | None:
    """A distinct, reproducible seed per (group, sample, continuation point); None stays random."""
    if seed is None:
        return None
    return zlib.crc32(f"{seed}/{group_id}/{sample_index}/{num_tokens_done}".encode())


def versions_per_token(spans, num_tokens: int, fallback: int) -> list[int]:
    """Expand vLLM's WeightVersionSpan list to one int version per output token."""
    versions = [fallback] * num_tokens
    for span in spans or ():
        versions[span.start : span.end] = [int(span.version)] * (span.end - span.start)
    return versions


def error_group(request: PromptRequest, num_samples: int, message: str) -> Group:
    """The Group answering a request that could not run: every sample "error", carrying `message`."""
    samples = [
        Sample(request.prompt_id, i, list(request.prompt_token_ids), finish_reason="error", error=message)
        for i in range(num_samples)
    ]
    return Group(request, samples)
