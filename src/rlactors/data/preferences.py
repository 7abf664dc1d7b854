"""Preference pairs for training a reward model (`rlactors.pipelines.reward_model_training`).

A pair is a prompt with two responses, the chosen one preferred:

    prompt     str    the prompt as the policy sees it (its chat template applied, if the run uses one)
    chosen     str    the preferred response
    rejected   str    the other response
    pair_id    str    optional; names the pair in errors ("<file stem>/<row>" when absent)

Files are parquet or JSON lines (`.jsonl`) with these columns. A row that is not a pair raises
`DataError` naming the file, row and field; nothing is skipped silently.

`synthetic_preference_pairs` makes seeded pairs a tiny policy can learn to satisfy: on the
arithmetic prompts (`37+45=`) the chosen response holds more digits than the rejected one, so a
reward model trained on them scores responses by their digits (the rule
`benchmarks/digit_reward.py` computes their share).
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlactors.data.prompts import DataError, row_error
from rlactors.data.synthetic import arithmetic_rows

# Characters of a synthetic response that are not digits: every other ASCII character (control
# characters included) and the replacement character, which is what an untrained policy's stray
# bytes decode to. A reward model never shown a character scores it at random.
NON_DIGITS = "".join(chr(code) for code in range(128) if not chr(code).isdigit()) + "\ufffd"


class PreferencePair(BaseModel):
    model_config = ConfigDict(extra="ignore")
    pair_id: str = Field(min_length=1, description="Names the pair in errors and metrics.")
    prompt: str = Field(min_length=1, description="The prompt as the policy sees it.")
    chosen: str = Field(description="The preferred response.")
    rejected: str = Field(description="The response the chosen one is preferred to.")


def validate_pairs(records: list[dict], source: str) -> list[PreferencePair]:
    """Every record as a `PreferencePair`; the first bad one raises, naming `source`, row and field."""
    pairs = []
    for index, record in enumerate(records):
        record = {"pair_id": f"{Path(source).stem}/{index}", **{k: v for k, v in record.items() if v is not None}}
        try:
            pairs.append(PreferencePair.model_validate(record))
        except ValidationError as error:
            raise DataError(row_error(source, index, error)) from None
    if not pairs:
        raise DataError(f"{source}: no preference pairs")
    return pairs


def read_preference_pairs(path: str | Path) -> list[PreferencePair]:
    """The pairs of a parquet or JSON-lines file (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such preference file")
    if path.suffix == ".jsonl":
        records = []
        for number, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise DataError(f"{path}: line {number + 1} is not JSON: {error}") from None
            if not isinstance(records[-1], dict):
                raise DataError(f"{path}: line {number + 1} is not a JSON object")
    else:
        try:
            records = pq.read_table(path).to_pylist()
        except (pa.ArrowInvalid, OSError) as error:
            raise DataError(f"{path}: not a readable parquet file (or .jsonl): {error}") from None
    return validate_pairs(records, str(path))


def synthetic_preference_pairs(num_pairs: int, seed: int = 0, split: str = "train") -> list[PreferencePair]:
    """Seeded pairs on the arithmetic prompts of `split`: responses of up to 4 characters, the
    chosen one (1 to 4 characters) with more digits than the rejected one (0 to 4), the rest of
    each drawn from `NON_DIGITS`."""
    rng = random.Random(f"preferences/{split}/{seed}")
    prompts = [row["prompt"][0]["content"] for row in arithmetic_rows(num_pairs, seed, split)]

    def response(length: int, num_digits: int) -> str:
        characters = [rng.choice(string.digits) for _ in range(num_digits)]
        characters += [rng.choice(NON_DIGITS) for _ in range(length - num_digits)]
        rng.shuffle(characters)
        return "".join(characters)

    pairs = []
    for index, prompt in enumerate(prompts):
        chosen_length, rejected_length = rng.randint(1, 4), rng.randint(0, 4)
        num_chosen_digits = rng.randint(1, chosen_length)
        num_rejected_digits = rng.randint(0, min(num_chosen_digits - 1, rejected_length))
        pairs.append(PreferencePair(pair_id=f"synthetic/digits/{split}/{index}", prompt=prompt,
                                    chosen=response(chosen_length, num_chosen_digits),
                                    rejected=response(rejected_length, num_rejected_digits)))
    return pairs
