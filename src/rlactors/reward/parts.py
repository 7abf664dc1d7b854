"""What a reward-model replica (`rlactors.reward.model_scorer`: a classifier, or a judge through
`rlactors.reward.judge`) does with the groups it is given, around its own way of scoring: which
samples it scores, and how its part joins each sample's reward.

    items = samples_to_score(groups, config, decode)       # [(where, prompt text, request, sample)]
    results = {where: Verdict(...)}                         # the scorer's own work
    groups = with_parts(groups, config, results, counts)    # score += weight x value, parts recorded

A sample is scored unless its data source is not one of the model's (`data_sources`) or it has a
`score_error` already (a rollout, environment or function failure: it trains with score 0, as
without models). Each sample gets `score_details["reward_parts"][name]`: the value, or 0.0 where the
model did not score it or failed. A failure scores the sample 0 with
`score_error = "prompt_id=... sample_index=...: reward model <name>: <error>"`. A judge's raw output
is kept in `score_details["reward_outputs"][name]`, for inspection.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from rlactors.config.reward_model import RewardModelConfig
from rlactors.reward.scorer import scored_samples
from rlactors.types import Group, PromptRequest, Sample

# Counters every reward-model replica keeps (`reward/<name>/<counter>`); a classifier also counts num_truncated.
COUNTERS = ("num_groups", "num_samples", "num_scored", "num_errors")

Where = tuple[int, int]  # (group index in the call, sample index in `scored_samples(group)`)


@dataclass
class Verdict:
    """One sample's result: its value, or the error that stopped it; `output` is what a judge wrote."""

    value: float | None = None
    error: str | None = None
    output: str | None = None


def part_metrics(name: str, counts: dict[str, int], scoring_s: float) -> dict[str, float]:
    """A reward-model replica's counters as metrics: `reward/<name>/<counter>`, `reward/<name>/scoring_s`."""
    return {f"reward/{name}/{counter}": float(value) for counter, value in counts.items()} | {
        f"reward/{name}/scoring_s": scoring_s}


def samples_to_score(groups: list[Group], config: RewardModelConfig,
                     decode: Callable[[list[int]], str]) -> list[tuple[Where, str, PromptRequest, Sample]]:
    """(where, the prompt's text as the policy saw it, its request, the sample) of each sample the model scores."""
    items = []
    for g, group in enumerate(groups):
        if config.data_sources is not None and group.request.data_source not in config.data_sources:
            continue
        prompt = decode(group.request.prompt_token_ids)
        items += [((g, i), prompt, group.request, sample) for i, sample in enumerate(scored_samples(group))
                  if sample.score_error is None]
    return items


def with_parts(groups: list[Group], config: RewardModelConfig, results: dict[Where, Verdict],
               counts: dict[str, int]) -> list[Group]:
    """The groups with the model's part added to each sample (see the module doc); `counts` counted."""
    scored = []
    for g, group in enumerate(groups):
        samples = [_with_part(sample, config, results.get((g, i)), counts)
                   for i, sample in enumerate(scored_samples(group))]
        baseline = samples.pop() if group.baseline is not None else None
        scored.append(replace(group, samples=samples, baseline=baseline))
    counts["num_groups"] += len(groups)
    return scored


def _with_part(sample: Sample, config: RewardModelConfig, verdict: Verdict | None, counts: dict[str, int]) -> Sample:
    name, value = config.name, 0.0
    counts["num_samples"] += 1
    score, error, details = (sample.score or 0.0), sample.score_error, dict(sample.score_details)
    if verdict is not None:
        if verdict.error is None:
            value, score = verdict.value, score + config.weight * verdict.value
            counts["num_scored"] += 1
        else:  # as a failing function: the sample trains with score 0, the error kept
            counts["num_errors"] += 1
            score = 0.0
            error = f"prompt_id={sample.prompt_id} sample_index={sample.sample_index}: reward model {name}: {verdict.error}"
        if verdict.output is not None:
            details["reward_outputs"] = dict(details.get("reward_outputs", {})) | {name: verdict.output}
    details["reward_parts"] = dict(details.get("reward_parts", {})) | {name: value}
    return replace(sample, score=score, score_error=error, score_details=details)
