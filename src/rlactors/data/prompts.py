"""Prompt data: veRL-schema parquet files, validated at load time, with a resumable cursor.

A row has veRL's columns:

    data_source   str                       e.g. "openai/gsm8k"; picks the reward scorer
    prompt        list[{role, content}]     chat messages
    ability       str                       e.g. "math"
    reward_model  {style, ground_truth}
    extra_info    {split, index, ...}       more keys are kept

Every row is validated before anything else starts: a bad row raises `DataError` naming the file,
row index, column and reason, or, with `skip_bad_rows`, is counted in `PromptDataset.skipped`.
Each row gets a stable `prompt_id` ("{data_source}/{split}/{index}"), unique within a data set.
`extra_info` travels with the prompt into every checkpoint (as JSON), so its values must be JSON's:
str, int, float (finite), bool, null, lists and dicts with string keys; a timestamp, bytes, a
decimal, NaN or a non-string key is refused here, naming the file, row and field.

`PromptDataset.lock` makes "advance the cursor and hand the rows on" one step for a checkpoint: a
feeder holds it from `next_batch` until the rows are in their destination (the replay buffer),
and a checkpoint holds it while it snapshots that destination and the cursor, so the two agree.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rlactors.types import json_text

COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")


class DataError(ValueError):
    """A data file or row is malformed; the message names file, row, column and reason."""


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str = Field(min_length=1, description="Chat role: system, user or assistant.")
    content: str = Field(description="Message text.")


class RewardSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    style: str = Field("rule", description="veRL reward style, usually 'rule'.")
    ground_truth: str = Field(description="Reference answer the scorer compares with.")

    @field_validator("ground_truth", mode="before")
    @classmethod
    def _number_to_text(cls, value: Any) -> Any:
        # Some public files store numeric answers as numbers; scorers compare text.
        return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


class ExtraInfo(BaseModel):
    model_config = ConfigDict(extra="allow")
    split: str = Field("train", description="Data split name.")
    index: int = Field(ge=0, description="Row index within the source data set (part of prompt_id).")


class PromptRow(BaseModel):
    """One validated row. `prompt_id` is derived, never read from the file."""

    model_config = ConfigDict(extra="allow")
    data_source: str = Field(min_length=1)
    prompt: list[Message] = Field(min_length=1)
    ability: str = ""
    reward_model: RewardSpec
    extra_info: ExtraInfo

    @property
    def prompt_id(self) -> str:
        return f"{self.data_source}/{self.extra_info.split}/{self.extra_info.index}"

    def to_record(self) -> dict:
        """The row as plain Python in veRL's schema (what `write_rows` writes)."""
        return self.model_dump(mode="python", exclude_none=True)


def row_error(source: str, index: int, error: ValidationError) -> str:
    """What a row that fails validation is refused with: file, row, the first bad column and why."""
    first = error.errors()[0]
    column = ".".join(str(part) for part in first["loc"]) or "?"
    message = f"{source}: row {index}: column {column}: {first['msg']}"
    if len(error.errors()) > 1:
        message += f" (and {len(error.errors()) - 1} more problems in this row)"
    return message


def validate_rows(records: list[dict], source: str, skip_bad_rows: bool = False) -> tuple[list[PromptRow], list[str]]:
    """Validate raw records; returns (rows, error messages of skipped rows)."""
    rows, errors, seen = [], [], {}
    for index, record in enumerate(records):
        try:
            row = PromptRow.model_validate(record)
            try:  # what a checkpoint will write: refused now rather than at the first checkpoint
                json_text(row.extra_info.model_dump(), f"{source}: row {index}: column extra_info", allow_nan=False)
            except ValueError as error:
                raise DataError(f"{error} (extra_info is saved as JSON in every checkpoint)") from None
            if row.prompt_id in seen:
                raise DataError(
                    f"{source}: row {index}: column extra_info: duplicate prompt_id {row.prompt_id!r} "
                    f"(also row {seen[row.prompt_id]}); (data_source, split, index) must be unique"
                )
        except ValidationError as error:
            message = row_error(source, index, error)
            if not skip_bad_rows:
                raise DataError(message) from None
            errors.append(message)
            continue
        except DataError as error:
            if not skip_bad_rows:
                raise
            errors.append(str(error))
            continue
        seen[row.prompt_id] = index
        rows.append(row)
    return rows, errors


def read_parquet_rows(path: str | Path, skip_bad_rows: bool = False) -> tuple[list[PromptRow], list[str]]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as error:
        raise DataError(f"{path}: not a readable parquet file: {error}") from None
    missing = [c for c in COLUMNS if c not in table.column_names and c != "ability"]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing}; veRL's schema has {list(COLUMNS)}")
    return validate_rows(table.to_pylist(), str(path), skip_bad_rows)


def write_rows(rows: list[dict] | list[PromptRow], path: str | Path) -> Path:
    """Write rows in veRL's schema to a parquet file."""
    records = [r.to_record() if isinstance(r, PromptRow) else r for r in rows]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


@dataclass
class PromptDataset:
    """Rows in a deterministic, seeded order per epoch, read through a resumable cursor.

    Checkpoint (`state_dict`): seed, epoch and position within the epoch; the rows themselves are
    reloaded from the files, and `load_state_dict` checks their count still matches. `lock` (see
    the module docstring) is re-entrant, so a feeder may hold it across calls that take it again.
    """

    rows: list[PromptRow]
    seed: int = 0
    shuffle: bool = True
    skipped: list[str] = field(default_factory=list)
    epoch: int = 0
    position: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.rows:
            raise DataError("data set is empty: no valid rows")
        self._order = self._epoch_order(self.epoch)

    @classmethod
    def from_files(cls, paths: list[str | Path], seed: int = 0, shuffle: bool = True, skip_bad_rows: bool = False):
        rows, skipped = [], []
        for path in paths:
            file_rows, file_skipped = read_parquet_rows(path, skip_bad_rows)
            rows += file_rows
            skipped += file_skipped
        # Uniqueness across files too (each file was checked on its own).
        validate_rows([r.to_record() for r in rows], "+".join(str(p) for p in paths))
        return cls(rows=rows, seed=seed, shuffle=shuffle, skipped=skipped)

    def __len__(self) -> int:
        return len(self.rows)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def next_batch(self, num_rows: int) -> list[PromptRow]:
        """The next `num_rows` rows, crossing into the next epoch (re-shuffled) when one ends."""
        batch = []
        while len(batch) < num_rows:
            if self.position == len(self.rows):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(num_rows - len(batch), len(self.rows) - self.position)
            batch += [self.rows[i] for i in self._order[self.position : self.position + take]]
            self.position += take
        return batch

    def state_dict(self) -> dict:
        return {"seed": self.seed, "shuffle": self.shuffle, "epoch": self.epoch, "position": self.position,
                "num_rows": len(self.rows)}

    def load_state_dict(self, state: dict) -> None:
        if state["num_rows"] != len(self.rows):
            raise DataError(
                f"cursor was saved for {state['num_rows']} rows but the data set has {len(self.rows)}: "
                "the data files changed since the checkpoint"
            )
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order(self.epoch)


def prompt_text(row: PromptRow, tokenizer=None, chat_template: bool = False) -> str:
    """The text the model sees: the chat template's rendering, or the message contents joined."""
    messages = [m.model_dump() for m in row.prompt]
    if chat_template:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return "".join(m["content"] for m in messages)


def tokenize_prompt(row: PromptRow, tokenizer, chat_template: bool = False, max_prompt_tokens: int | None = None) -> list[int]:
    ids = tokenizer(prompt_text(row, tokenizer, chat_template), add_special_tokens=False)["input_ids"]
    if not ids:
        raise DataError(f"prompt_id {row.prompt_id!r}: prompt is empty after formatting")
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        raise DataError(f"prompt_id {row.prompt_id!r}: prompt has {len(ids)} tokens > max_prompt_tokens={max_prompt_tokens}")
    return ids


def to_request(row: PromptRow, tokenizer, chat_template: bool = False, max_prompt_tokens: int | None = None,
               attempt: int = 0):
    """A `PromptRequest` for the rollout engines; `attempt` numbers re-issues of the same prompt."""
    from rlactors.types import PromptRequest

    return PromptRequest(
        prompt_id=row.prompt_id,
        group_id=f"{row.prompt_id}#{attempt}",
        prompt_token_ids=tokenize_prompt(row, tokenizer, chat_template, max_prompt_tokens),
        data_source=row.data_source,
        ground_truth=row.reward_model.ground_truth,
        extra_info=row.extra_info.model_dump(),
    )
