"""A reward model among a run's scorers (`reward.models`): a sequence classifier whose one logit per
sequence, times its weight, is added to each sample's reward (`rlactors.reward.model_scorer`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlactors.config.section import Section


class RewardModelConfig(Section):
    name: str = Field(
        ..., pattern=r"^[A-Za-z0-9_.-]+$", description="The model's part of the reward: kept per sample in "
        "score_details['reward_parts'][name] and logged as reward/<name>/mean. Letters, digits, '_', '.', '-'.",
    )
    path: str = Field(..., description="Hugging Face folder of a sequence classifier with one label "
                      "(AutoModelForSequenceClassification, e.g. one `rlactors` trained on preference pairs).")
    kind: Literal["classifier"] = Field("classifier", description="A discriminative reward model: its logit is the score.")
    weight: float = Field(1.0, description="Its score's weight in the sample's reward (the sum over scorers).")
    input_format: Literal["join", "chat"] = Field(
        "join", description="What the model reads: the prompt as the policy saw it followed by the response "
        "(join), or the two as a user and an assistant message through the reward model's chat template (chat).",
    )
    data_sources: list[str] | None = Field(
        None, description="Rows of these data sources are scored by it (their part is 0 elsewhere); None: every row.",
    )
    batch_size: int = Field(16, ge=1, description="Sequences per forward pass.")
    max_tokens: int = Field(
        4096, ge=2, description="Longest sequence it reads; longer ones keep their last max_tokens tokens (the "
        "response's end, where a classifier reads its score) and are counted in reward/<name>/num_truncated.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights' dtype.")
    num_replicas: int = Field(1, ge=1, description="Actors holding a copy of the model; groups go to the least loaded.")
    num_cpus_per_replica: float = Field(0.0, ge=0, description="Ray CPUs reserved per replica.")
    own_devices: bool = Field(
        False, description="Each replica on a device of its own (a `reward` pool of the plan, beside the others). "
        "Otherwise replicas share devices, as `rlactors plan` shows: the colocated pool's, or in async mode the "
        "training pool's, one replica per device in turn. A replica runs on the accelerator of its device, else on CPU.",
    )
