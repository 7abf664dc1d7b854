"""Prompt data: `prompts` reads and validates veRL-schema parquet files into a resumable
`PromptDataset` (everything it exports is here); `synthetic` writes small seeded tasks in that
schema (arithmetic, GSM8K-like, MATH-like) for tests, the demo and examples; `preferences` reads
and makes the preference pairs a reward model trains on (`rlactors train-reward-model`)."""

from rlactors.data.prompts import (
    COLUMNS,
    DataError,
    ExtraInfo,
    Message,
    PromptDataset,
    PromptRow,
    RewardSpec,
    prompt_text,
    read_parquet_rows,
    to_request,
    tokenize_prompt,
    validate_rows,
    write_rows,
)

__all__ = [
    "COLUMNS",
    "DataError",
    "ExtraInfo",
    "Message",
    "PromptDataset",
    "PromptRow",
    "RewardSpec",
    "prompt_text",
    "read_parquet_rows",
    "to_request",
    "tokenize_prompt",
    "validate_rows",
    "write_rows",
]
