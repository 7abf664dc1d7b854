"""The numbers of a validation or evaluation pass, from scored responses: plain functions.

Per data source, over the prompts of that source:
- `acc`: the mean accuracy over every response (`score_details["acc"]`, else the score). Greedy
  with one response per prompt, it is pass@1; with n sampled responses it is mean@n.
- `pass@k` for k = 1, 2, 4, ... up to n (and n itself), when n > 1 responses per prompt: the
  chance that at least one of k responses drawn from the n is correct (accuracy > 0), by the
  unbiased estimator 1 - C(n-c, k) / C(n, k) of Chen et al. 2021, averaged over prompts.

The training loop's validation (`rlactors.pipelines.common.validate`) and `python -m rlactors eval`
both report these, through `BatchBuilder.validation_report`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np

from rlactors.types import Group


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `num_correct` of `num_samples` responses correct."""
    if not 0 < k <= num_samples or not 0 <= num_correct <= num_samples:
        raise ValueError(f"pass@{k} of {num_correct} correct in {num_samples}: need 0 < k <= n and 0 <= c <= n")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def k_values(num_samples: int) -> list[int]:
    """1, 2, 4, ... below `num_samples`, and `num_samples` itself."""
    values = [1 << i for i in range(num_samples.bit_length()) if 1 << i < num_samples]
    return [*values, num_samples]


def sample_accuracy(sample) -> float:
    value = sample.score_details.get("acc", sample.score)
    return float(value or 0.0)


def validation_metrics(accuracies: Iterable[tuple[str, list[float]]]) -> dict[str, float]:
    """`{source}/acc` and, where prompts have n > 1 responses, `{source}/pass@k`, from
    (data source, accuracy of each response) per prompt. Prompts of one source with different
    numbers of responses get pass@k for the k every one of them allows."""
    per_source: dict[str, list[list[float]]] = {}
    for source, values in accuracies:
        if values:
            per_source.setdefault(source, []).append(values)
    metrics: dict[str, float] = {}
    for source, prompts in sorted(per_source.items()):
        metrics[f"{source}/acc"] = float(np.mean([v for values in prompts for v in values]))
        smallest = min(len(values) for values in prompts)
        if smallest > 1:
            for k in k_values(smallest):
                metrics[f"{source}/pass@{k}"] = float(np.mean(
                    [pass_at_k(len(values), sum(v > 0 for v in values), k) for values in prompts]))
    return metrics


def group_metrics(groups: Iterable[Group]) -> dict[str, float]:
    return validation_metrics((g.request.data_source, [sample_accuracy(s) for s in g.samples]) for g in groups)


def sample_rows(groups: Iterable[Group], decode: Callable[[list[int]], str]) -> list[dict]:
    """One row per response: what a per-sample report holds (prompt and response text, score)."""
    rows = []
    for group in groups:
        prompt = decode(group.request.prompt_token_ids)
        for sample in group.samples:
            rows.append({
                "prompt_id": group.prompt_id, "data_source": group.request.data_source,
                "sample_index": sample.sample_index, "prompt": prompt, "response": sample.text,
                "ground_truth": group.request.ground_truth, "score": sample.score, "acc": sample_accuracy(sample),
                "num_response_tokens": sample.num_response_tokens, "num_model_tokens": sample.num_model_tokens,
                "num_turns": sample.num_turns, "num_tool_calls": sample.num_tool_calls,
                "finish_reason": sample.finish_reason,
                "error": sample.error or sample.score_error,
            })
    return rows
