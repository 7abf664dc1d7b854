"""The reward-model scorer actor: one replica of a reward model (`reward.models`), which adds the
model's weighted part to the reward of each sample it is given: a sequence classifier's logit (kind
classifier, the functions here), or an LLM judge's verdict through its engine (kind judge,
`rlactors.reward.judge`).

`rlactors.reward.pool.RewardPool` chains the scorers on each group, refs in and refs out: the function
scorer first (which sets `score` to its weighted part, `rlactors.reward.scorer`), then each model's
replicas in turn. Which samples a model scores and how its part joins the reward (`weight * value`,
kept in `score_details["reward_parts"][name]`): `rlactors.reward.parts`.

A classifier's forward pass that raises is retried one sequence at a time, so the error lands on the samples that
cause it (each scores 0, the error in its `score_error`); the batch's other samples are scored.
Scoring is a pure function of its input, so Ray may restart a killed replica and retry the call:
each group is scored once (a judge's verdicts are too when it samples greedily, its default).

Time-sharing (colocated, `rlactors.pipelines.colocated`): `offload()` moves a classifier's weights
to host memory and puts a judge's engine to sleep while the trainer has the device; `onload()`
brings them back before the next rollout. A scoring call while offloaded onloads first.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import ray

from rlactors.config.reward_model import RewardModelConfig
from rlactors.config.section import ConfigError
from rlactors.models.folders import is_model_folder
from rlactors.reward.judge import judge_verdicts, verdict_parser
from rlactors.reward.parts import COUNTERS as PART_COUNTERS
from rlactors.reward.parts import Verdict, part_metrics, samples_to_score, with_parts
from rlactors.reward.scorer import saved_counters
from rlactors.runtime.calls import error_text, get_within
from rlactors.runtime.device import detect_platform
from rlactors.types import Group

__all__ = ["RewardModelScorer", "classifier_text", "classifier_token_ids", "located", "score_sequences"]

COUNTERS = (*PART_COUNTERS, "num_truncated")


def classifier_text(prompt: str, response: str, input_format: str, tokenizer) -> str:
    """What the classifier reads for one sample: the prompt followed by the response, or the two as
    a user and an assistant message through the classifier's chat template."""
    if input_format == "join":
        return prompt + response
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("input_format 'chat' needs a chat template in the reward model's tokenizer")
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return tokenizer.apply_chat_template(messages, tokenize=False)


def classifier_token_ids(tokenizer, texts: list[str], max_tokens: int) -> tuple[list[list[int]], int]:
    """(each text's token ids as the classifier reads them, cut to the last `max_tokens`; the
    number cut). Its training (`rlactors.pipelines.reward_model_training`) reads texts the same way."""
    encoded = [tokenizer(text)["input_ids"] for text in texts]
    return [ids[-max_tokens:] for ids in encoded], sum(len(ids) > max_tokens for ids in encoded)


def score_sequences(model, tokenizer, texts: list[str], batch_size: int,
                    max_tokens: int) -> tuple[list[tuple[float | None, str | None]], int]:
    """(one (logit, error) per text, in order; the number of texts cut to their last `max_tokens`
    tokens). A batch whose forward raises is scored one text at a time, pinning errors on the texts
    that cause them."""
    import torch

    encoded, num_truncated = classifier_token_ids(tokenizer, texts, max_tokens)
    device = next(model.parameters()).device
    # transformers' classifier pools each row at its last token that is not `config.pad_token_id`:
    # padding with another id (the tokenizer's own) would pool a short row at its padding.
    pad_id = model.config.pad_token_id

    def forward(batch: list[list[int]]) -> list[float]:
        padded = tokenizer.pad({"input_ids": batch}, padding=True, return_tensors="pt")
        input_ids = padded["input_ids"]
        if pad_id is not None:
            input_ids = input_ids.masked_fill(padded["attention_mask"] == 0, pad_id)
        with torch.no_grad():
            logits = model(input_ids=input_ids.to(device), attention_mask=padded["attention_mask"].to(device)).logits
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


def located(index: int, model: RewardModelConfig) -> RewardModelConfig:
    """The model's settings with its folder's absolute path (replicas may run in another working
    directory). A path that holds no model, or a judge's verdict function that does not load, is an
    error naming the field: checked before any actor starts (`rlactors.pipelines.preflight`, the pool)."""
    path = Path(model.path).expanduser().resolve()
    if not is_model_folder(path):
        raise ConfigError(f"reward.models[{index}].path: {model.path} ({model.name!r}) holds no Hugging Face model "
                          "folder (config.json and *.safetensors or *.bin)")
    if model.kind == "judge":
        try:
            verdict_parser(model.judge.verdict)
        except Exception as error:  # user code: an import can raise anything
            raise ConfigError(f"reward.models[{index}].judge.verdict={model.judge.verdict!r} ({model.name!r}) does "
                              f"not load: {error_text(error, first_line=True)}") from None
    return model.model_copy(update={"path": str(path)})


def load_classifier(config: RewardModelConfig):
    """(model in eval mode on the accelerator Ray gave this process, else on CPU; its tokenizer)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from rlactors.models import load_tokenizer, padding_token_id

    tokenizer = load_tokenizer(config.path)
    model = AutoModelForSequenceClassification.from_pretrained(config.path, dtype=getattr(torch, config.dtype),
                                                               local_files_only=True)
    if model.config.num_labels != 1:
        raise ValueError(f"reward model {config.name!r} at {config.path}: a classifier with one label is needed, "
                         f"it has {model.config.num_labels}")
    if model.config.pad_token_id is None:  # batches are padded: the model must find each sequence's last token
        model.config.pad_token_id = padding_token_id(tokenizer)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = model.config.pad_token_id
    device = "cpu" if detect_platform() == "cpu" else "cuda"  # ROCm's torch names its GPUs cuda too
    return model.to(device).eval(), tokenizer


@ray.remote(max_restarts=2, max_task_retries=2)  # a pure function of its input: retries are safe
class RewardModelScorer:
    """One replica of a reward model: a classifier it holds, or a judge `engine` (a RolloutEngine)
    it sends messages to. Checkpoint (`state_dict`): its cumulative counters only; the model is
    loaded again from `config.path`. A restarted replica's counters start from zero."""

    def __init__(self, config: RewardModelConfig, policy_tokenizer_path: str, engine=None) -> None:
        from rlactors.models import load_tokenizer

        self.config, self.engine = config, engine
        if config.kind == "classifier":
            self.model, self.tokenizer = load_classifier(config)
        else:
            self.tokenizer, self.parse = load_tokenizer(config.path), verdict_parser(config.judge.verdict)
        # Prompts travel as the policy's token ids: its tokenizer gives back the text the policy saw.
        self.policy_tokenizer = load_tokenizer(policy_tokenizer_path)
        self.device = next(self.model.parameters()).device if config.kind == "classifier" else None
        self.offloaded = False
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.scoring_s = 0.0

    def ready(self) -> bool:
        """True once the model can score: a judge's engine has started (within judge.start_timeout_s)."""
        if self.engine is not None:
            ray.get(self.engine.ready.remote(), timeout=self.config.judge.start_timeout_s)
        return True

    def score(self, group: Group) -> Group:
        return self._score_groups([group])[0]

    def score_groups(self, *groups: Group) -> list[Group]:
        """Call with `.options(num_returns=len(groups))` to get one ref per group."""
        return self._score_groups(list(groups))

    def offload(self) -> int:
        """Give the device up: a classifier's weights to host memory (the allocator's cache released),
        a judge's engine asleep. Returns the bytes moved (0 for a judge, whose engine logs its own);
        already offloaded, nothing happens."""
        return self._move(offload=True)

    def onload(self) -> int:
        """Take the device back (the inverse of `offload`)."""
        return self._move(offload=False)

    def _move(self, offload: bool) -> int:
        from rlactors.trainer.offload import HOST, move_state, release_cached_memory

        if self.offloaded == offload:
            return 0
        moved_bytes = 0
        if self.engine is not None:
            method = "sleep" if offload else "wake_up"
            get_within(getattr(self.engine, method).remote(), self.config.judge.call_timeout_s,
                       f"reward model {self.config.name!r}: its judge engine's {method}")
        else:
            moved_bytes = move_state(self.model, None, HOST if offload else self.device)
            release_cached_memory(self.device)
        self.offloaded = offload
        return moved_bytes

    def metrics(self) -> dict[str, float]:
        return part_metrics(self.config.name, self.counts, self.scoring_s)

    def state_dict(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "scoring_s": self.scoring_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts, self.scoring_s = saved_counters(state, COUNTERS, f"reward model {self.config.name!r}")

    # ----------------------------------------------------------------------------------------

    def _score_groups(self, groups: list[Group]) -> list[Group]:
        start = time.perf_counter()
        self.onload()  # a no-op unless a call comes while offloaded (colocated runs call onload first)
        config = self.config
        items = samples_to_score(groups, config, self.policy_tokenizer.decode)
        if config.kind == "judge":
            verdicts = judge_verdicts(self.engine, self.tokenizer, self.parse, items, config.judge)
        else:
            texts = [classifier_text(prompt, sample.text, config.input_format, self.tokenizer)
                     for _, prompt, _, sample in items]
            results, num_truncated = score_sequences(self.model, self.tokenizer, texts, config.batch_size,
                                                     config.max_tokens)
            verdicts = {where: Verdict(value, error) for (where, *_), (value, error) in zip(items, results, strict=True)}
            self.counts["num_truncated"] += num_truncated
        scored = with_parts(groups, config, verdicts, self.counts)
        self.scoring_s += time.perf_counter() - start
        return scored
