"""A reward-model training job (`rlactors train-reward-model`, `rlactors.pipelines.reward_model_training`):
a one-label sequence classifier trained on preference pairs with the Bradley-Terry loss, through an
FSDP trainer group, written as the Hugging Face folder a `reward.models` classifier loads."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlactors.config.section import Section
from rlactors.config.sections import OptimConfig, TrainerConfig


class RewardTrainingConfig(Section):
    model_path: str = Field(
        ..., description="Folder the reward model starts from: a causal LM (its backbone, with a new one-label head "
        "initialised from `seed`) or a one-label sequence classifier (trained further).",
    )
    model_preset: str | None = Field(
        None, description="A random-init model of this preset ('tiny', 'small', ...) is built at model_path when that "
        "folder is absent or empty (as model.build_if_missing); null: model_path must hold a model.",
    )
    output_path: str = Field(..., description="Where the trained reward model's Hugging Face folder is written "
                             "(replaced once the new one is whole).")
    train_path: str | None = Field(
        None, description="Preference pairs (parquet or .jsonl with prompt, chosen, rejected and optional pair_id "
        "columns; `rlactors.data.preferences`); null: seeded synthetic pairs that prefer responses with more digits.",
    )
    val_path: str | None = Field(
        None, description="Held-out pairs whose accuracy is reported after training; null: synthetic held-out pairs "
        "when train_path is null too, else no held-out accuracy.",
    )
    num_synthetic_pairs: int = Field(512, ge=1, description="Synthetic training pairs (train_path null).")
    num_synthetic_val_pairs: int = Field(64, ge=1, description="Synthetic held-out pairs (val_path and train_path null).")
    input_format: Literal["join", "chat"] = Field(
        "join", description="How prompt and response become the text the model reads; the same as the scorer's "
        "`reward.models[].input_format` will be (`rlactors.reward.model_scorer.classifier_text`).",
    )
    max_tokens: int = Field(4096, ge=2, description="Longest text read; longer ones keep their last max_tokens tokens, "
                            "as the scorer cuts them.")
    num_epochs: int = Field(1, ge=1, description="Passes over the training pairs, each in a new seeded order.")
    batch_size_pairs: int = Field(32, ge=1, description="Pairs per optimizer step.")
    seed: int = Field(0, description="Seeds the new head and the order of the pairs.")
    trainer: TrainerConfig = Field(
        default_factory=lambda: TrainerConfig(optim=OptimConfig(lr=1e-4)),
        description="The FSDP group that trains it: ranks, CPUs, optimizer (trainer.optim), micro-batch token budget, "
        "timeouts. Its num_mini_batches and num_epochs are not read (batch_size_pairs and num_epochs above are).",
    )
