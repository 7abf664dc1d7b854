"""Misbehaving reward functions in a real colocated run on the tiny model: the run goes on, each
faulty sample says which prompt it belongs to and what went wrong, nothing is lost or left behind;
and a function that fails everywhere stops the run with its first error."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from chaos_helpers import assert_each_prompt_once, assert_no_leftovers, checkpoint_ledger, leftover_processes
from tiny_runs import record_scored_batches, tiny_config

from rlactors.pipelines import run_pipeline
from rlactors.reward.failures import ScoringFailedError

pytestmark = [pytest.mark.vllm, pytest.mark.chaos]

# By a hash of the prompt and the response text, so a group's samples get different faults.
FAULTY_REWARD = """
import math, os, subprocess, zlib

FAULTS = ["ok", "ok", "hang", "raise", "nan", "string", "exit", "mutate", "spawn"]

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    prompt_id = f"{data_source}/{extra_info['split']}/{extra_info['index']}"
    if "touched_by" in extra_info:
        raise AssertionError(f"extra_info changed by another sample: {extra_info['touched_by']}")
    fault = FAULTS[zlib.crc32((prompt_id + solution_str).encode()) % len(FAULTS)]
    if fault == "hang":
        while True:
            pass
    if fault == "raise":
        raise RuntimeError("reward function failed on purpose")
    if fault == "nan":
        return math.nan
    if fault == "string":
        return "1.0"
    if fault == "exit":
        os._exit(3)
    if fault == "mutate":
        extra_info["touched_by"] = solution_str
    if fault == "spawn":
        child = subprocess.Popen(["sleep", "600"])
        open(os.path.join(PID_DIR, str(child.pid)), "w").close()
    return float(len(solution_str) % 2)
"""

EXPECTED_ERRORS = ("TimeoutError", "RuntimeError: reward function failed on purpose", "ValueError: score is nan",
                   "TypeError: score must be", "worker process died (exit code 3)")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(900)
def test_run_survives_every_kind_of_faulty_reward_function(warm_actors, tmp_path, tiny_model_dir, monkeypatch):
    pid_dir = tmp_path / "grandchildren"
    pid_dir.mkdir()
    reward = tmp_path / "faulty_reward.py"
    reward.write_text(f"PID_DIR = {str(pid_dir)!r}\n" + textwrap.dedent(FAULTY_REWARD))
    batches = record_scored_batches(monkeypatch)
    before = leftover_processes()
    config = tiny_config(tmp_path, tiny_model_dir, f"reward.custom_function={reward}:compute_score",
                         "reward.timeout_s=2", "pipeline.checkpoint_every_steps=2")

    history = run_pipeline(config, warm=warm_actors)

    assert [h["step"] for h in history] == [0, 1, 2]
    samples = [s for _, groups in batches for g in groups for s in g.samples]
    errors = [s.score_error for s in samples if s.score_error is not None]
    assert sum(h["reward/num_score_errors"] for h in history[1:]) == len(errors) == sum(n for n, _ in batches)
    assert 0 < len(errors) < len(samples)
    for sample in samples:
        if sample.score_error is not None:
            assert sample.score_error.startswith(f"prompt_id={sample.prompt_id} sample_index={sample.sample_index}: ")
            assert any(kind in sample.score_error for kind in EXPECTED_ERRORS), sample.score_error
            assert sample.score == 0.0
    assert not any("extra_info changed" in text for text in errors)  # each call had its own copy
    kinds = {kind for text in errors for kind in EXPECTED_ERRORS if kind in text}
    assert len(kinds) >= 3, kinds  # the hash spread several faults over the batches
    assert_each_prompt_once(checkpoint_ledger(config.pipeline.output_dir))
    assert_no_leftovers(before, warm=warm_actors)
    grandchildren = [int(path.name) for path in pid_dir.iterdir()]
    assert grandchildren and [pid for pid in grandchildren if alive(pid)] == []


@pytest.mark.timeout(900)
def test_scoring_that_fails_everywhere_stops_the_run_with_the_first_error(warm_actors, tmp_path, tiny_model_dir):
    reward = tmp_path / "failing_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1 / 0\n")
    before = leftover_processes()
    config = tiny_config(tmp_path, tiny_model_dir, f"reward.custom_function={reward}:compute_score",
                         "reward.max_failed_steps=2", "pipeline.num_steps=4")
    metrics = Path(config.pipeline.output_dir) / "metrics.jsonl"

    with pytest.raises(ScoringFailedError, match=r"every sample for 2 steps in a row .* first error: "
                                                 r"prompt_id=synthetic/arithmetic/\S+ sample_index=\d+: "
                                                 r"ZeroDivisionError"):
        run_pipeline(config, warm=warm_actors)

    assert len(metrics.read_text().splitlines()) == 2  # step 0's validation and step 1: step 2 raised
    assert warm_actors.kept is not None  # the engines did not fail: kept, at rest, for the next run
    assert_no_leftovers(before, warm=warm_actors)
