"""Seeded generators of small synthetic tasks, written in veRL's parquet schema.

- arithmetic: `37+45=` -> `82` (data_source "synthetic/arithmetic"; the response is the number)
- gsm8k: short word problems; the answer ends in `#### <number>` ("synthetic/gsm8k")
- math: fractions to simplify, answered as `\\boxed{...}` ("synthetic/math")

They feed the CPU demo and the tests; the same seed gives the same rows.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from rlactors.data import write_rows

DATA_SOURCES = {"arithmetic": "synthetic/arithmetic", "gsm8k": "synthetic/gsm8k", "math": "synthetic/math"}


def _row(task: str, content: str, ground_truth: str, split: str, index: int, **extra) -> dict:
    return {
        "data_source": DATA_SOURCES[task],
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, **extra},
    }


def arithmetic_rows(num_rows: int, seed: int = 0, split: str = "train", max_operand: int = 99,
                    exclude: set[tuple[int, int]] | None = None) -> list[dict]:
    """`a+b=` problems with a, b in [0, max_operand]; `exclude` keeps train and test disjoint."""
    rng = random.Random(f"arithmetic/{split}/{seed}")
    rows, used = [], set(exclude or ())
    if num_rows > (max_operand + 1) ** 2 - len(used):
        raise ValueError(f"only {(max_operand + 1) ** 2 - len(used)} distinct problems, asked for {num_rows}")
    while len(rows) < num_rows:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if (a, b) in used:
            continue
        used.add((a, b))
        rows.append(_row("arithmetic", f"{a}+{b}=", str(a + b), split, len(rows), operands=[a, b]))
    return rows


_ITEMS = ["apples", "pencils", "marbles", "books", "stickers", "coins"]
_NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Farah"]


def gsm8k_rows(num_rows: int, seed: int = 0, split: str = "train") -> list[dict]:
    """Two-step word problems; veRL's GSM8K ground truth is the bare final number."""
    rng = random.Random(f"gsm8k/{split}/{seed}")
    rows = []
    for index in range(num_rows):
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        start, bought, groups = rng.randint(2, 40), rng.randint(2, 20), rng.randint(2, 5)
        answer = (start + bought) * groups
        question = (f"{name} has {start} {item} and buys {bought} more. Then {name} ends up with {groups} times "
                    f"that many. How many {item} does {name} have?")
        solution = f"{start}+{bought}={start + bought}. {start + bought}*{groups}={answer}.\n#### {answer}"
        rows.append(_row("gsm8k", question, str(answer), split, index, answer=solution))
    return rows


def math_rows(num_rows: int, seed: int = 0, split: str = "train") -> list[dict]:
    """Fractions to simplify; the answer is a LaTeX fraction (or integer) to put in \\boxed{}."""
    rng = random.Random(f"math/{split}/{seed}")
    rows = []
    for index in range(num_rows):
        numerator, denominator, factor = rng.randint(1, 20), rng.randint(2, 20), rng.randint(2, 9)
        divisor = math.gcd(numerator, denominator)
        p, q = numerator // divisor, denominator // divisor
        answer = str(p) if q == 1 else f"\\frac{{{p}}}{{{q}}}"
        question = f"Simplify $\\frac{{{numerator * factor}}}{{{denominator * factor}}}$. Put the answer in \\boxed{{}}."
        rows.append(_row("math", question, answer, split, index))
    return rows


def make_task_rows(task: str, num_rows: int, seed: int = 0, split: str = "train", **kwargs) -> list[dict]:
    generators = {"arithmetic": arithmetic_rows, "gsm8k": gsm8k_rows, "math": math_rows}
    if task not in generators:
        raise ValueError(f"task {task!r}: allowed values are {sorted(generators)}")
    return generators[task](num_rows, seed=seed, split=split, **kwargs)


def write_task(task: str, directory: str | Path, num_train_rows: int, num_val_rows: int, seed: int = 0) -> tuple[Path, Path]:
    """Write `train.parquet` and `test.parquet` for a task; the test split never repeats a train problem."""
    directory = Path(directory)
    train = make_task_rows(task, num_train_rows, seed, "train")
    if task == "arithmetic":
        seen = {tuple(r["extra_info"]["operands"]) for r in train}
        test = arithmetic_rows(num_val_rows, seed, "test", exclude=seen)
    else:
        test = make_task_rows(task, num_val_rows, seed, "test")
    return write_rows(train, directory / "train.parquet"), write_rows(test, directory / "test.parquet")
