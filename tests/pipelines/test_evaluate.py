"""`python -m rlactors eval`: real engines and reward scorers over a validation set, on the tiny model."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlactors.config import ConfigError
from rlactors.data import read_parquet_rows
from rlactors.metrics.evaluation import pass_at_k
from rlactors.pipelines.evaluate import eval_config, run_eval

pytestmark = pytest.mark.vllm
PARITY = Path(__file__).resolve().parents[1] / "parity_reward.py"  # accuracy varies even for a random model
NUM_PROMPTS, NUM_SAMPLES = 6, 4


def test_eval_of_a_model_folder_reports_pass_at_k_and_every_response(ray_session, tiny_model_dir, tmp_path):
    config = eval_config(str(tiny_model_dir), [
        f"pipeline.output_dir={tmp_path}", f"data.num_val_rows={NUM_PROMPTS}", "rollout.max_model_len=64",
        f"rollout.validation_sampling.num_samples_per_prompt={NUM_SAMPLES}", "rollout.validation_sampling.temperature=1.0",
        "rollout.validation_sampling.max_response_tokens=6", "rollout.validation_sampling.seed=0",
        "reward.num_workers=1", f"reward.custom_function={PARITY}:compute_score"])
    assert config.model.path == str(Path(tiny_model_dir).absolute())
    report = run_eval(config)
    assert json.loads((tmp_path / "eval" / "report.json").read_text()) == report
    assert report["num_prompts"] == NUM_PROMPTS

    rows = pq.read_table(tmp_path / "eval" / "samples.parquet").to_pylist()
    assert len(rows) == NUM_PROMPTS * NUM_SAMPLES
    [source] = {row["data_source"] for row in rows}
    metrics = report["metrics"]
    assert sorted(metrics) == sorted(f"val/{source}/{name}" for name in ("acc", "pass@1", "pass@2", "pass@4"))
    # The report is what the rows say: recomputed from the parquet file.
    assert metrics[f"val/{source}/acc"] == pytest.approx(sum(row["acc"] for row in rows) / len(rows))
    assert 0 < metrics[f"val/{source}/acc"] < 1  # the parity reward: some right, some wrong
    by_prompt: dict[str, list[float]] = {}
    for row in rows:
        by_prompt.setdefault(row["prompt_id"], []).append(row["acc"])
        assert row["acc"] == len(row["response"]) % 2 and row["error"] is None
    for k in (2, 4):
        expected = sum(pass_at_k(NUM_SAMPLES, sum(v > 0 for v in values), k) for values in by_prompt.values())
        assert metrics[f"val/{source}/pass@{k}"] == pytest.approx(expected / NUM_PROMPTS)
    prompts = {row.prompt_id: row.prompt[0].content for row in read_parquet_rows(report["val_files"][0])[0]}
    assert all(row["prompt"] == prompts[row["prompt_id"]] for row in rows)  # decoded back to the data set's text


def test_eval_refuses_a_folder_without_a_model(tmp_path):
    with pytest.raises(ConfigError, match="holds no config.json"):
        eval_config(str(tmp_path), [])
