"""Plain functions the rollout engine and router share: checking a prompt and its sampling settings,
per-sample seeds, a sample's tokens from vLLM's output (and vLLM's own version labels, a check),
the Group that reports a failed request, and the small
summary of a finished Group that the router reads instead of the Group itself."""

from __future__ import annotations

import sys
import zlib
from dataclasses import dataclass

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


def sampling_per_request(sampling: SamplingArg | list[SamplingArg], num_requests: int) -> list[SamplingArg]:
    """One sampling argument per request: a list gives one for each, anything else is for all."""
    per_request = sampling if isinstance(sampling, list) else [sampling] * num_requests
    if len(per_request) != num_requests:
        raise ValueError(f"got {len(per_request)} sampling settings for {num_requests} requests")
    return per_request


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


def extend_sample(sample: Sample, completion, policy_version: int) -> str:
    """Append a vLLM `CompletionOutput`'s tokens and sampled-token logprobs to `sample`, each token
    labelled `policy_version` (the weights of the whole request: `rlactors.rollout.admission`);
    returns its text."""
    token_ids = list(completion.token_ids)
    sample.response_token_ids += token_ids
    sample.response_logprobs += [position[token].logprob
                                 for position, token in zip(completion.logprobs or [], token_ids, strict=True)]
    sample.token_policy_versions += [policy_version] * len(token_ids)
    return completion.text


def vllm_disagrees(completion, policy_version: int) -> bool:
    """Whether vLLM (>= 0.32, which labels each step with its weight version) says some token of
    `completion` came from other weights than `policy_version`; older vLLMs label nothing."""
    spans = getattr(completion, "weight_versions", None) or ()
    return any(int(span.version) != policy_version for span in spans if span.end > span.start)


def error_group(request: PromptRequest, num_samples: int, message: str) -> Group:
    """The Group answering a request that could not run: every sample "error", carrying `message`."""
    samples = [
        Sample(request.prompt_id, i, list(request.prompt_token_ids), finish_reason="error", error=message)
        for i in range(num_samples)
    ]
    return Group(request, samples)


@dataclass
class GroupSummary:
    """What the driver reads of a finished Group: a few numbers per sample, no tokens or text.
    The Group itself stays in the object store and travels as a ref to the scorers and the buffer."""

    group_id: str
    prompt_id: str
    response_lengths: list[int]
    finish_reasons: list[str]
    policy_versions: list[int]  # the distinct versions of the group's tokens, ascending
    error: str | None = None  # the first sample's rollout error, if any

    @property
    def num_samples(self) -> int:
        return len(self.response_lengths)

    def __reduce__(self):
        # One per group reaches the driver: positional fields pickle to half the bytes of a field dict.
        return GroupSummary, (self.group_id, self.prompt_id, self.response_lengths, self.finish_reasons,
                              self.policy_versions, self.error)


def summarize_group(group: Group) -> GroupSummary:
    errors = [s.error for s in group.samples if s.error]
    # Interned, so pickle writes each distinct reason once and back-references the repeats.
    reasons = [sys.intern(s.finish_reason) for s in group.samples]
    return GroupSummary(group.group_id, group.prompt_id, [s.num_response_tokens for s in group.samples], reasons,
                        group.policy_versions, errors[0] if errors else None)
