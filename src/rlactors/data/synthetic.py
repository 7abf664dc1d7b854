"""Seeded generators of small synthetic tasks, written in veRL's parquet schema.

- arithmetic: `37+45=` -> `82` (data_source "synthetic/arithmetic"; the response is the number)
- gsm8k: short word problems; the answer ends in `#### <number>` ("synthetic/gsm8k")
- math: fractions to simplify, answered as `\\boxed{...}` ("synthetic/math")
- calculator: `37*58=` with a `calc` tool (`[calc 37*58]` -> `=2146`), answered `2146`
- python: `Sum 12..40?` with a `python` tool (`[python print(sum(range(12,41)))]`)
- guess_number: a secret in 1..16, guessed in turns told higher or lower
- tools: the three above, interleaved, so one run exercises every built-in environment
- countdown: `12,...,01=` -> `12,11,10,09,...,01` ("synthetic/countdown"), the start log-normal so
  that the correct responses' lengths are long-tailed (median ~30 tokens, p99 ~8x that, at most 297)

Rows of the environment tasks name their environment in `extra_info["environment"]` (and its
settings in `extra_info["environment_kwargs"]`); their train and test splits are disjoint by a
hash of the problem, so each split can be generated alone.

They feed the CPU demo and the tests; the same seed gives the same rows.
"""

from __future__ import annotations

import math
import random
import zlib
from pathlib import Path

from rlactors.data import write_rows

DATA_SOURCES = {"arithmetic": "synthetic/arithmetic", "gsm8k": "synthetic/gsm8k", "math": "synthetic/math",
                "calculator": "synthetic/calculator", "python": "synthetic/python",
                "guess_number": "synthetic/guess_number", "countdown": "synthetic/countdown"}


def _row(task: str, content: str, ground_truth: str, split: str, index: int, ability: str = "math", **extra) -> dict:
    return {
        "data_source": DATA_SOURCES[task],
        "prompt": [{"role": "user", "content": content}],
        "ability": ability,
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


def _in_split(problem: object, split: str) -> bool:
    # One problem in 8 is held out: a stable hash (not Python's salted one) keeps it so across runs.
    held_out = zlib.crc32(repr(problem).encode()) % 8 == 0
    return held_out != (split == "train")


def _environment_rows(task: str, environment: str, num_rows: int, seed: int, split: str, draw,
                      ability: str = "math") -> list[dict]:
    """Rows of problems from `draw(rng) -> (problem, prompt, ground_truth, environment_kwargs)`,
    kept to the split's side of the hash."""
    rng = random.Random(f"{task}/{split}/{seed}")
    rows = []
    while len(rows) < num_rows:
        problem, content, ground_truth, environment_kwargs = draw(rng)
        if not _in_split(problem, split):
            continue
        extra = {"environment": environment, "problem": " ".join(map(str, problem))}  # one type: parquet
        if environment_kwargs:
            extra["environment_kwargs"] = environment_kwargs
        rows.append(_row(task, content, str(ground_truth), split, len(rows), ability, **extra))
    return rows


def calculator_rows(num_rows: int, seed: int = 0, split: str = "train") -> list[dict]:
    """`a*b=` with a, b of 2 or 3 digits: too hard to do in the head of a tiny model, easy with a `calc`."""
    def draw(rng):
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        return (a, b), f"{a}*{b}=", a * b, None

    return _environment_rows("calculator", "calculator", num_rows, seed, split, draw)


def python_rows(num_rows: int, seed: int = 0, split: str = "train") -> list[dict]:
    """Sums of integer ranges and of squares, answerable with one `print`."""
    def draw(rng):
        if rng.random() < 0.5:
            low, high = rng.randint(1, 50), rng.randint(51, 300)
            return ("sum", low, high), f"Sum {low}..{high}?", sum(range(low, high + 1)), None
        high = rng.randint(5, 99)
        return ("squares", 1, high), f"Sum of squares 1..{high}?", sum(i * i for i in range(1, high + 1)), None

    return _environment_rows("python", "python", num_rows, seed, split, draw, ability="code")


def guess_number_rows(num_rows: int, seed: int = 0, split: str = "train", low: int = 1, high: int = 16) -> list[dict]:
    """A secret in [low, high] to guess in turns; the prompt states the game (rows repeat: 16 secrets)."""
    def draw(rng):
        secret = rng.randint(low, high)
        return (low, high, secret), f"Guess my number {low}-{high}:", secret, {"low": low, "high": high}

    return _environment_rows("guess_number", "guess_number", num_rows, seed, split, draw, ability="game")


def tools_rows(num_rows: int, seed: int = 0, split: str = "train") -> list[dict]:
    """calculator, python and guess_number rows interleaved (c, p, g, c, p, g, ...)."""
    generators = (calculator_rows, python_rows, guess_number_rows)
    parts = [generator(len(range(i, num_rows, len(generators))), seed, split) for i, generator in enumerate(generators)]
    return [parts[i % len(parts)][i // len(parts)] for i in range(num_rows)]


# The countdown's start N: log-normal, median 10, sigma 1, redrawn above 99; the answer is 3N tokens
# with its end-of-sequence. Measured over 4000 rows (seeds 0-2): train p50 30 tokens, p99 231-237
# (7.7-7.9x); test p50 27, p99 213-216 (7.9-8x); at most 297.
COUNTDOWN_START = {"median": 10, "sigma": 1.0, "max": 99}
COUNTDOWN_SEPARATORS = " ,;/|:"


def countdown(start: int, separator: str = " ") -> str:
    """`start`, `start - 1`, ..., 1 as two digits, joined by `separator`: the countdown task's answer."""
    return separator.join(f"{n:02d}" for n in range(start, 0, -1))


def countdown_rows(num_rows: int, seed: int = 0, split: str = "train") -> list[dict]:
    """`12,...,01=` -> `12,11,10,09,...,01`: a response whose length the prompt sets and whose correct
    lengths are long-tailed (`COUNTDOWN_START`; for the char-level tokenizer a character is a token).
    Each next number and the stop depend only on the number before, so the small model learns it in
    a short warm-up and then writes the long tail itself; counting N copies of a pattern, or numbers
    of one and two digits mixed, it does not learn in minutes. The separator (`COUNTDOWN_SEPARATORS`)
    makes 594 problems, so that the test split, disjoint by a hash of (start, separator), still
    spans the lengths of the training split."""
    rng = random.Random(f"countdown/{split}/{seed}")
    median, sigma, largest = COUNTDOWN_START["median"], COUNTDOWN_START["sigma"], COUNTDOWN_START["max"]
    rows = []
    while len(rows) < num_rows:
        start = max(1, round(rng.lognormvariate(math.log(median), sigma)))
        separator = rng.choice(COUNTDOWN_SEPARATORS)
        if start > largest or not _in_split((start, separator), split):
            continue
        rows.append(_row("countdown", f"{start:02d}{separator}...{separator}01=", countdown(start, separator), split,
                         len(rows), "counting", start=start, separator=separator))
    return rows


GENERATORS = {"arithmetic": arithmetic_rows, "gsm8k": gsm8k_rows, "math": math_rows, "calculator": calculator_rows,
              "python": python_rows, "guess_number": guess_number_rows, "tools": tools_rows,
              "countdown": countdown_rows}


def make_task_rows(task: str, num_rows: int, seed: int = 0, split: str = "train", **kwargs) -> list[dict]:
    generators = GENERATORS
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
