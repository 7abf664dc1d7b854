"""Preference pairs: files read whole or refused naming file, row and field; synthetic pairs seeded,
split apart, and always preferring the response with more digits."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlactors.data import DataError
from rlactors.data.preferences import read_preference_pairs, synthetic_preference_pairs


def test_synthetic_pairs_prefer_more_digits_and_repeat_per_seed():
    pairs = synthetic_preference_pairs(200, seed=3)
    assert pairs == synthetic_preference_pairs(200, seed=3) != synthetic_preference_pairs(200, seed=4)
    for pair in pairs:
        digits = [sum(c.isdigit() for c in text) for text in (pair.chosen, pair.rejected)]
        assert digits[0] > digits[1] and 1 <= len(pair.chosen) <= 4 and len(pair.rejected) <= 4
    assert any(not pair.rejected for pair in pairs) and any("\ufffd" in p.chosen + p.rejected for p in pairs)
    assert len({pair.pair_id for pair in pairs}) == 200
    assert all(pair.pair_id.startswith("synthetic/digits/train/") for pair in pairs)
    held_out = synthetic_preference_pairs(50, seed=3, split="test")
    assert all(pair.pair_id.startswith("synthetic/digits/test/") for pair in held_out)
    assert [p.chosen for p in held_out] != [p.chosen for p in pairs[:50]]


def test_parquet_and_json_lines_read_alike_with_ids_named_or_derived(tmp_path):
    rows = [{"prompt": "2+2=", "chosen": "4", "rejected": "five", "pair_id": None}, {"prompt": "1+1=", "chosen": "2", "rejected": "",
                                                                      "pair_id": "mine"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet")
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + "\n")
    from_parquet = read_preference_pairs(tmp_path / "pairs.parquet")
    assert [p.pair_id for p in from_parquet] == ["pairs/0", "mine"]
    assert [p.model_dump() for p in from_parquet] == [p.model_dump() for p in read_preference_pairs(tmp_path / "pairs.jsonl")]


def test_a_bad_row_names_its_file_row_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "x"}\n{"prompt": "1+2=", "chosen": "3"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl: row 1: column rejected: Field required"):
        read_preference_pairs(path)
    path.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "x"}\nnot json\n')
    with pytest.raises(DataError, match="bad.jsonl: line 2 is not JSON"):
        read_preference_pairs(path)
    with pytest.raises(DataError, match="no such preference file"):
        read_preference_pairs(tmp_path / "missing.parquet")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl: no preference pairs"):
        read_preference_pairs(tmp_path / "empty.jsonl")
