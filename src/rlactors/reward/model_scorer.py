"""The reward-model scorer actor: a sequence classifier (one logit per sequence) that adds its
weighted score to the reward of each sample it is given (`reward.models`).

`rlactors.reward.pool.RewardPool` chains the scorers on each group, refs in and refs out: the function
scorer first (which sets `score` to its weighted part, `rlactors.reward.scorer`), then each model's
replicas in turn. A model scoring sample s adds `weight * logit` to `s.score` and records the logit
in `s.score_details["reward_parts"][name]`, so the reward is the weighted sum of the parts and each part
is logged on its own (`reward/<name>/mean`).

A sample the model does not score keeps its score, with part 0.0: its data source is not one of the
model's (`data_sources`), or it has a `score_error` already (a rollout, environment or function
failure: it trains with score 0, as without models). A forward pass that raises is retried one
sequence at a time, so the error lands on the samples that cause it: score 0, part 0.0 and
`score_error = "prompt_id=... sample_index=...: reward model <name>: <exception>"`; the batch's
other samples are scored. Scoring is a pure function of its input, so Ray may restart a killed
replica and retry the call: each group is scored once.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import ray

from rlactors.config.reward_model import RewardModelConfig
from rlactors.reward.scorer import saved_counters, scored_samples
from rlactors.runtime.calls import error_text
from rlactors.types import Group, Sample

__all__ = ["RewardModelScorer", "classifier_text", "score_sequences"]

COUNTERS = ("num_groups", "num_samples", "num_scored", "num_errors", "num_truncated")


def classifier_text(prompt: str, response: str, input_format: str, tokenizer) -> str:
    """What the classifier reads for one sample: the prompt followed by the response, or the two as
    a user and an assistant message through the classifier's chat template."""
    if input_format == "join":
        return prompt + response
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("input_format 'chat' needs a chat template in the reward model's tokenizer")
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return tokenizer.apply_chat_template(messages, tokenize=False)


def score_sequences(model, tokenizer, texts: list[str], batch_size: int,
                    max_tokens: int) -> tuple[list[tuple[float | None, str | None]], int]:
    """(one (logit, error) per text, in order; the number of texts cut to their last `max_tokens`
    tokens). A batch whose forward raises is scored one text at a time, pinning errors on the texts
    that cause them."""
    import torch

    encoded = [tokenizer(text)["input_ids"] for text in texts]
    num_truncated = sum(len(ids) > max_tokens for ids in encoded)
    encoded = [ids[-max_tokens:] for ids in encoded]
    device = next(model.parameters()).device

    def forward(batch: list[list[int]]) -> list[float]:
        padded = tokenizer.pad({"input_ids": batch}, padding=True, return_tensors="pt")
        with torch.no_grad():
            logits = model(input_ids=padded["input_ids"].to(device),
                           attention_mask=padded["attention_mask"].to(device)).logits
        return [float(value) for value in logits[:, 0].float().cpu()]

    results: list[tuple[float | None, str | None]] = []
    for start in range(0, len(encoded), batch_size):
        batch = encoded[start:start + batch_size]
        try:
            results += [(value, None) for value in forward(batch)]
        except Exception:  # noqa: BLE001 - retried alone below; what each one raises is recorded
            for ids in batch:
                try:
                    results.append((forward([ids])[0], None))
                except Exception as error:  # noqa: BLE001 - recorded on the sample
                    results.append((None, error_text(error, max_chars=500)))
    return results, num_truncated


def load_classifier(config: RewardModelConfig):
    """(model in eval mode on the accelerator Ray gave this process, else on CPU; its tokenizer)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.path)
    model = AutoModelForSequenceClassification.from_pretrained(config.path, dtype=getattr(torch, config.dtype),
                                                               local_files_only=True)
    if model.config.num_labels != 1:
        raise ValueError(f"reward model {config.name!r} at {config.path}: a classifier with one label is needed, "
                         f"it has {model.config.num_labels}")
    if model.config.pad_token_id is None:  # batches are padded: the model must find each sequence's last token
        model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = model.config.pad_token_id
    device = "cuda" if torch.cuda.is_available() else "cpu"  # ROCm's torch names its GPUs cuda too
    return model.to(device).eval(), tokenizer


@ray.remote(max_restarts=2, max_task_retries=2)  # a pure function of its input: retries are safe
class RewardModelScorer:
    """One replica of a reward model. Checkpoint (`state_dict`): its cumulative counters only; the
    model is loaded again from `config.path`. A restarted replica's counters start from zero."""

    def __init__(self, config: RewardModelConfig, policy_tokenizer_path: str) -> None:
        from rlactors.models import load_tokenizer

        self.config = config
        self.model, self.tokenizer = load_classifier(config)
        # Prompts travel as the policy's token ids: its tokenizer gives back the text the policy saw.
        self.policy_tokenizer = load_tokenizer(policy_tokenizer_path)
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.scoring_s = 0.0

    def ready(self) -> bool:
        return True

    def score(self, group: Group) -> Group:
        return self._score_groups([group])[0]

    def score_groups(self, *groups: Group) -> list[Group]:
        """Call with `.options(num_returns=len(groups))` to get one ref per group."""
        return self._score_groups(list(groups))

    def metrics(self) -> dict[str, float]:
        prefix = f"reward/{self.config.name}"
        return {f"{prefix}/{name}": float(value) for name, value in self.counts.items()} | {
            f"{prefix}/scoring_s": self.scoring_s}

    def state_dict(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "scoring_s": self.scoring_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts, self.scoring_s = saved_counters(state, COUNTERS, f"reward model {self.config.name!r}")

    # ----------------------------------------------------------------------------------------

    def _score_groups(self, groups: list[Group]) -> list[Group]:
        start = time.perf_counter()
        config = self.config
        texts, where = [], []
        for g, group in enumerate(groups):
            if config.data_sources is not None and group.request.data_source not in config.data_sources:
                continue
            prompt = self.policy_tokenizer.decode(group.request.prompt_token_ids)
            for i, sample in enumerate(scored_samples(group)):
                if sample.score_error is None:
                    texts.append(classifier_text(prompt, sample.text, config.input_format, self.tokenizer))
                    where.append((g, i))
        results, num_truncated = score_sequences(self.model, self.tokenizer, texts, config.batch_size, config.max_tokens)
        found = dict(zip(where, results, strict=True))
        scored = []
        for g, group in enumerate(groups):
            samples = [self._add_part(s, found.get((g, i))) for i, s in enumerate(scored_samples(group))]
            baseline = samples.pop() if group.baseline is not None else None
            scored.append(replace(group, samples=samples, baseline=baseline))
        self.counts["num_groups"] += len(groups)
        self.counts["num_truncated"] += num_truncated
        self.scoring_s += time.perf_counter() - start
        return scored

    def _add_part(self, sample: Sample, result: tuple[float | None, str | None] | None) -> Sample:
        """The sample with this model's part added; `result` is None where the model did not score it."""
        name, value = self.config.name, 0.0
        self.counts["num_samples"] += 1
        score, error = (sample.score or 0.0), sample.score_error
        if result is not None:
            logit, failure = result
            if failure is None:
                value, score = logit, score + self.config.weight * logit
                self.counts["num_scored"] += 1
            else:  # as a failing function: the sample trains with score 0, the error kept
                self.counts["num_errors"] += 1
                score = 0.0
                error = f"prompt_id={sample.prompt_id} sample_index={sample.sample_index}: reward model {name}: {failure}"
        parts = dict(sample.score_details.get("reward_parts", {})) | {name: value}
        return replace(sample, score=score, score_error=error, score_details=sample.score_details | {"reward_parts": parts})

