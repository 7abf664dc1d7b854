import datetime
import decimal
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlactors.buffer.storage import json_text
from rlactors.data import DataError, PromptDataset, read_parquet_rows, to_request, validate_rows, write_rows
from rlactors.data.synthetic import (
    COUNTDOWN_SEPARATORS,
    arithmetic_rows,
    countdown,
    countdown_rows,
    gsm8k_rows,
    make_task_rows,
    math_rows,
    write_task,
)
from rlactors.models import build_char_tokenizer


def test_generators_are_seeded_and_in_verl_schema(tmp_path):
    for task in ("arithmetic", "gsm8k", "math", "countdown"):
        rows = make_task_rows(task, 20, seed=3)
        assert rows == make_task_rows(task, 20, seed=3)
        assert rows != make_task_rows(task, 20, seed=4)
        path = write_rows(rows, tmp_path / f"{task}.parquet")
        loaded, skipped = read_parquet_rows(path)
        assert skipped == [] and len(loaded) == 20
        assert set(pq.read_schema(path).names) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}


def test_generated_answers_are_right():
    for row in arithmetic_rows(50):
        a, b = row["prompt"][0]["content"].rstrip("=").split("+")
        assert int(row["reward_model"]["ground_truth"]) == int(a) + int(b)
    for row in gsm8k_rows(20):
        assert row["extra_info"]["answer"].endswith(f"#### {row['reward_model']['ground_truth']}")
    assert all("\\boxed" in row["prompt"][0]["content"] for row in math_rows(5))


def test_arithmetic_test_split_is_disjoint_from_train(tmp_path):
    train, test = write_task("arithmetic", tmp_path, 500, 100)
    train_prompts = {r.prompt[0].content for r in read_parquet_rows(train)[0]}
    test_prompts = {r.prompt[0].content for r in read_parquet_rows(test)[0]}
    assert len(test_prompts) == 100 and not train_prompts & test_prompts


def test_countdown_answers_and_disjoint_splits(tmp_path):
    assert countdown(12, ",") == "12,11,10,09,08,07,06,05,04,03,02,01" and countdown(1) == "01"
    for row in countdown_rows(50, seed=1):
        start, separator = row["extra_info"]["start"], row["extra_info"]["separator"]
        assert row["prompt"][0]["content"] == f"{start:02d}{separator}...{separator}01="
        assert row["reward_model"]["ground_truth"] == countdown(start, separator)
    train, test = write_task("countdown", tmp_path, 2000, 300)
    train_prompts = {r.prompt[0].content for r in read_parquet_rows(train)[0]}
    test_prompts = {r.prompt[0].content for r in read_parquet_rows(test)[0]}
    assert not train_prompts & test_prompts
    assert {p[2] for p in test_prompts} == set(COUNTDOWN_SEPARATORS) and len(test_prompts) > 30


@pytest.mark.parametrize("split", ["train", "test"])
def test_countdown_answer_lengths_are_long_tailed(split):
    """Tokens of the correct responses (one a character, plus end-of-sequence): median ~30, p99
    ~8x that, capped below 300: the long tail a streaming rollout should absorb."""
    longest = countdown(99, "|")
    assert len(build_char_tokenizer()(longest, add_special_tokens=False)["input_ids"]) == len(longest) == 296
    lengths = sorted(len(r["reward_model"]["ground_truth"]) + 1 for r in countdown_rows(3000, seed=0, split=split))
    p50, p99 = lengths[len(lengths) // 2], lengths[len(lengths) * 99 // 100]
    assert 24 <= p50 <= 36
    assert 6.5 <= p99 / p50 <= 9.5
    assert lengths[-1] <= 297 and lengths[0] <= 6


def _bad_file(tmp_path):
    rows = arithmetic_rows(6)
    rows[2]["reward_model"] = {"style": "rule"}  # no ground_truth
    rows[4]["prompt"] = []  # no messages
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_malformed_row_names_file_row_and_column(tmp_path):
    path = _bad_file(tmp_path)
    with pytest.raises(DataError) as error:
        read_parquet_rows(path)
    message = str(error.value)
    assert str(path) in message and "row 2" in message and "reward_model.ground_truth" in message


def test_skip_bad_rows_counts_and_keeps_the_rest(tmp_path):
    dataset = PromptDataset.from_files([_bad_file(tmp_path)], skip_bad_rows=True)
    assert len(dataset) == 4
    assert len(dataset.skipped) == 2
    assert "row 2" in dataset.skipped[0] and "row 4" in dataset.skipped[1] and "column prompt" in dataset.skipped[1]


def test_missing_column_and_unreadable_file(tmp_path):
    path = tmp_path / "nocol.parquet"
    pq.write_table(pa.table({"data_source": ["x"]}), path)
    with pytest.raises(DataError, match=r"missing column\(s\).*prompt"):
        read_parquet_rows(path)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet")
    with pytest.raises(DataError, match="not a readable parquet"):
        read_parquet_rows(garbage)
    with pytest.raises(DataError, match="no such data file"):
        read_parquet_rows(tmp_path / "absent.parquet")


def test_duplicate_prompt_ids_are_reported_across_files(tmp_path):
    first = write_rows(arithmetic_rows(3), tmp_path / "a.parquet")
    second = write_rows(arithmetic_rows(3, seed=1), tmp_path / "b.parquet")  # same split and indexes
    with pytest.raises(DataError, match="duplicate prompt_id 'synthetic/arithmetic/train/0'"):
        PromptDataset.from_files([first, second])


def test_numeric_ground_truth_is_accepted_as_text(tmp_path):
    rows = arithmetic_rows(2)
    for row in rows:
        row["reward_model"]["ground_truth"] = int(row["reward_model"]["ground_truth"])
    loaded, _ = read_parquet_rows(write_rows(rows, tmp_path / "n.parquet"))
    assert loaded[0].reward_model.ground_truth == str(rows[0]["reward_model"]["ground_truth"])


def test_cursor_is_deterministic_and_round_trips(tmp_path):
    rows = read_parquet_rows(write_rows(arithmetic_rows(10), tmp_path / "t.parquet"))[0]
    uninterrupted = PromptDataset(rows, seed=7)
    expected = [r.prompt_id for r in uninterrupted.next_batch(4) + uninterrupted.next_batch(9)]
    assert len(set(expected[:10])) == 10  # one epoch visits every row once
    assert expected[:10] != [r.prompt_id for r in rows]  # shuffled

    first = PromptDataset(rows, seed=7)
    got = [r.prompt_id for r in first.next_batch(4)]
    state = first.state_dict()
    resumed = PromptDataset(rows, seed=0)
    resumed.load_state_dict(state)
    got += [r.prompt_id for r in resumed.next_batch(9)]
    assert got == expected
    with pytest.raises(DataError, match="data files changed"):
        PromptDataset(rows[:5]).load_state_dict(state)


def test_prompt_ids_are_stable_and_requests_tokenize(tmp_path):
    rows = read_parquet_rows(write_rows(arithmetic_rows(3), tmp_path / "t.parquet"))[0]
    assert [r.prompt_id for r in rows] == [f"synthetic/arithmetic/train/{i}" for i in range(3)]
    tokenizer = build_char_tokenizer()
    request = to_request(rows[0], tokenizer)
    assert tokenizer.decode(request.prompt_token_ids) == rows[0].prompt[0].content
    assert request.ground_truth == rows[0].reward_model.ground_truth
    chat = to_request(rows[0], tokenizer, chat_template=True, attempt=2)
    assert chat.group_id.endswith("#2") and tokenizer.decode(chat.prompt_token_ids).endswith("<|im_start|>assistant\n")
    with pytest.raises(DataError, match="synthetic/arithmetic/train/0.*max_prompt_tokens=2"):
        to_request(rows[0], tokenizer, max_prompt_tokens=2)


@pytest.mark.parametrize("value, kind", [
    (datetime.datetime(2024, 5, 1, 12, 0), "datetime"), (b"\x00raw", "bytes"), (decimal.Decimal("1.25"), "Decimal"),
    (float("nan"), "nan"),
])
def test_extra_info_a_checkpoint_cannot_store_is_refused_at_load(tmp_path, value, kind):
    """Every prompt's extra_info is written (as JSON) into each checkpoint: a value JSON cannot
    hold exactly is refused when the file is read, naming file, row and field."""
    rows = arithmetic_rows(3)
    rows[1]["extra_info"]["when"] = value
    path = write_rows(rows, tmp_path / "extra.parquet")
    with pytest.raises(DataError) as error:
        read_parquet_rows(path)
    message = str(error.value)
    assert str(path) in message and "row 1" in message and "extra_info.when" in message and kind in message
    dataset = PromptDataset.from_files([path], skip_bad_rows=True)
    assert len(dataset) == 2 and "row 1" in dataset.skipped[0]


def test_extra_info_with_non_string_keys_is_refused():
    records = arithmetic_rows(2)
    records[1]["extra_info"]["lookup"] = {"ok": [1, 2.5, None, True], 7: "seven"}
    with pytest.raises(DataError, match=r"mem: row 1: column extra_info\.lookup: key 7 is not a string"):
        validate_rows(records, "mem")
    records[1]["extra_info"]["lookup"] = {"ok": [1, 2.5, None, True, {"nested": "text"}]}
    rows, _ = validate_rows(records, "mem")  # JSON's own types pass and survive a checkpoint exactly
    assert json.loads(json_text(rows[1].extra_info.model_dump(), "")) == rows[1].extra_info.model_dump()
