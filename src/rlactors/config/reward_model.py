"""A reward model among a run's scorers (`reward.models`): a sequence classifier whose one logit per
sequence (`rlactors.reward.model_scorer`), or an LLM judge whose verdict on each response
(`rlactors.reward.judge`), times its weight, is added to each sample's reward."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlactors.config.section import Section

DEFAULT_JUDGE_TEMPLATE = (
    "Rate the response to the question below from 0 (wrong or unhelpful) to 10 (correct and helpful).\n\n"
    "Question:\n{prompt}\n\nResponse:\n{response}\n\nReference answer (may be empty): {ground_truth}\n\n"
    "End with your rating as 'Score: N'."
)


class JudgeConfig(Section):
    template: str = Field(
        DEFAULT_JUDGE_TEMPLATE, description="The judge's message; {prompt}, {response} and {ground_truth} are "
        "filled in (the prompt as the policy saw it, the response's text, the row's ground truth).",
    )
    chat_template: bool = Field(True, description="Send the message through the judge tokenizer's chat template as a "
                                "user turn, generation prompt added (off: the message as plain text).")
    verdict: str = Field(
        "score", description="How the judge's output becomes a number: 'score' (its last 'score: N' or 'score = N', "
        "any case), 'brackets' (its last '[[N]]'), or a user function 'module:function' / 'path/to/file.py:function' "
        "taking the output text and returning a number. No verdict: the sample scores 0, the output in score_error.",
    )
    temperature: float = Field(0.0, ge=0.0, description="The judge's sampling temperature; 0 is greedy.")
    max_response_tokens: int = Field(256, ge=1, description="Most tokens the judge writes per verdict.")
    max_model_len: int = Field(4096, ge=16, description="The judge engine's longest message + verdict in tokens; "
                               "a longer message is an error on its sample.")
    gpu_memory_utilization: float = Field(
        0.3, gt=0.0, le=1.0, description="Share of its device's memory the judge's vLLM may use (weights and KV cache).",
    )
    enforce_eager: bool = Field(True, description="Skip CUDA graph / torch.compile capture in the judge engine.")
    start_timeout_s: float = Field(600.0, gt=0, description="Most seconds the judge engine may take to start.")
    call_timeout_s: float = Field(
        600.0, gt=0, description="Most seconds the judge may take over one scoring call's verdicts; past it each "
        "sample still waiting scores 0 with the timeout in score_error.",
    )


class RewardModelConfig(Section):
    name: str = Field(
        ..., pattern=r"^[A-Za-z0-9_.-]+$", description="The model's part of the reward: kept per sample in "
        "score_details['reward_parts'][name] and logged as reward/<name>/mean. Letters, digits, '_', '.', '-'.",
    )
    path: str = Field(..., description="Hugging Face folder: a sequence classifier with one label "
                      "(AutoModelForSequenceClassification) for `classifier`, a causal LM for `judge`.")
    kind: Literal["classifier", "judge"] = Field(
        "classifier", description="classifier: its logit on prompt + response is the score. judge: an LLM served by "
        "a rollout engine (vLLM) reads a message built from the sample (`judge.template`) and writes a verdict.",
    )
    judge: JudgeConfig = Field(default_factory=JudgeConfig, description="The judge's message, verdict and engine "
                               "(kind judge).")
    weight: float = Field(1.0, description="Its score's weight in the sample's reward (the sum over scorers).")
    input_format: Literal["join", "chat"] = Field(
        "join", description="What a classifier reads: the prompt as the policy saw it followed by the response "
        "(join), or the two as a user and an assistant message through the reward model's chat template (chat).",
    )
    data_sources: list[str] | None = Field(
        None, description="Rows of these data sources are scored by it (their part is 0 elsewhere); None: every row.",
    )
    batch_size: int = Field(16, ge=1, description="A classifier's sequences per forward pass.")
    max_tokens: int = Field(
        4096, ge=2, description="Longest sequence a classifier reads; longer ones keep their last max_tokens tokens "
        "(the response's end, where a classifier reads its score), counted in reward/<name>/num_truncated.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights' dtype (a judge's "
                                                             "engine too).")
    num_replicas: int = Field(1, ge=1, description="Actors holding a copy of the model; groups go to the least loaded.")
    num_cpus_per_replica: float = Field(0.0, ge=0, description="Ray CPUs reserved per replica.")
    own_devices: bool = Field(
        False, description="Each replica on a device of its own (a `reward` pool of the plan, beside the others). "
        "Otherwise replicas share devices, as `rlactors plan` shows: the colocated pool's, or in async mode the "
        "training pool's, one replica per device in turn. A replica runs on the accelerator of its device, else on CPU.",
    )
