from decimal import Decimal

import pytest

from rlactors.data import read_parquet_rows
from rlactors.data.synthetic import make_task_rows, write_task
from rlactors.environments import BUILTIN_ENVIRONMENTS
from rlactors.environments.calculator import calculate
from rlactors.environments.python_tool import run_python

TASKS = ("calculator", "python", "guess_number", "tools")


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_disjoint_and_named(task, tmp_path):
    rows = make_task_rows(task, 30, seed=2)
    assert rows == make_task_rows(task, 30, seed=2) and rows != make_task_rows(task, 30, seed=3)
    test = make_task_rows(task, 30, seed=2, split="test")
    problems = lambda split_rows: {(r["data_source"], r["extra_info"]["problem"]) for r in split_rows}  # noqa: E731
    assert not problems(rows) & problems(test)
    for row in rows:
        assert row["extra_info"]["environment"] in BUILTIN_ENVIRONMENTS
        assert len(row["prompt"][0]["content"]) <= 40  # tiny models have ~256 characters in all
    train_path, _ = write_task(task, tmp_path, 12, 6)
    loaded, skipped = read_parquet_rows(train_path)
    assert skipped == [] and len(loaded) == 12


def test_tools_interleaves_every_environment():
    environments = [row["extra_info"]["environment"] for row in make_task_rows("tools", 7)]
    assert environments == ["calculator", "python", "guess_number"] * 2 + ["calculator"]


def test_answers_are_right():
    for row in make_task_rows("calculator", 10):
        assert Decimal(calculate(row["prompt"][0]["content"].rstrip("="))) == Decimal(row["reward_model"]["ground_truth"])
    for row in make_task_rows("python", 4):
        kind, low, high = row["extra_info"]["problem"].split()
        power = 1 if kind == "sum" else 2
        code = f"print(sum(i ** {power} for i in range({low}, {high} + 1)))"
        assert run_python(code).strip() == row["reward_model"]["ground_truth"]
    for row in make_task_rows("guess_number", 10):
        assert 1 <= int(row["reward_model"]["ground_truth"]) <= 16
