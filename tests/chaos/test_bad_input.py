"""Runs that cannot work fail before any actor starts, with their cause: a prompt longer than the
context allows, and more resources than the cluster has. Neither starts an engine."""

import os
import subprocess
import sys

import pytest
import ray
from chaos_helpers import assert_no_leftovers, leftover_processes

from rlactors.config import dump_config, load_config
from rlactors.data import write_rows
from rlactors.pipelines import run_pipeline
from rlactors.placement import PlanError

pytestmark = pytest.mark.chaos

LONG_PROMPT_ID = "synthetic/arithmetic/train/2"


def cluster_history() -> tuple[int, int]:
    """(actors, placement groups) the connected cluster has ever had, dead and removed ones included:
    a run that started even one of either adds to it. Read from the GCS: Ray's state API
    (`ray.util.state`) needs a dashboard, which the suite's local Ray does not run."""
    return len(ray._private.state.actors()), len(ray.util.placement_group_table())


def assert_nothing_started(before_history: tuple[int, int], before_processes: dict[int, str]) -> None:
    assert cluster_history() == before_history, "the run created actors or placement groups"
    assert leftover_processes().keys() <= before_processes.keys(), "an engine core or reward worker started"
    assert_no_leftovers(before_processes)


def bad_input_config(tmp_path, model_dir, *overrides):
    # Row 2 has 61 tokens: the engine itself would take it (61 < max_model_len), but 61 prompt
    # tokens + 4 response tokens do not fit the 64-token context.
    rows = [{"data_source": "synthetic/arithmetic", "prompt": [{"role": "user", "content": text}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "3"}, "extra_info": {"split": "train", "index": index}}
            for index, text in enumerate(["1+2=", "2+1=", "1+" * 30 + "=", "0+3="])]
    train = write_rows(rows, tmp_path / "train.parquet")
    return load_config(None, [
        f"model.path={model_dir}", f"data.train_files=[{train}]", "data.num_val_rows=4", "rollout.max_model_len=64",
        "rollout.sampling.num_samples_per_prompt=2", "rollout.sampling.max_response_tokens=4",
        "rollout.validation_sampling.max_response_tokens=4", "pipeline.num_steps=2", "pipeline.batch_size_prompts=2",
        f"pipeline.output_dir={tmp_path / 'run'}", "pipeline.resume=never", *overrides,
    ])


def test_a_prompt_longer_than_the_context_fails_the_run_before_any_actor_starts(ray_session, tmp_path, tiny_model_dir):
    """Through the command line, as a user runs it: exit status 2, one error line naming the prompt,
    its file and the numbers, no traceback, and the cluster it was pointed at never saw an actor."""
    before_history, before_processes = cluster_history(), leftover_processes()
    config_path = tmp_path / "config.yaml"
    dump_config(bad_input_config(tmp_path, tiny_model_dir), config_path)
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    result = subprocess.run([sys.executable, "-m", "rlactors", "run", str(config_path)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"training prompt_id {LONG_PROMPT_ID!r} in {tmp_path / 'train.parquet'}" in result.stderr
    assert "61 prompt tokens + rollout.sampling.max_response_tokens=4 = 65 > rollout.max_model_len=64" in result.stderr
    assert "Traceback" not in result.stderr
    assert_nothing_started(before_history, before_processes)


def test_an_infeasible_resource_request_fails_naming_the_resource_and_leaves_nothing(ray_session, tmp_path,
                                                                                   tiny_model_dir):
    """8 trainer ranks of 1 CPU on the suite's 4-CPU cluster: refused by the placement plan, once Ray
    is up but before a placement group or an actor exists."""
    before_history, before_processes = cluster_history(), leftover_processes()
    config = bad_input_config(tmp_path, tiny_model_dir, "data.train_files=[]", "data.num_train_rows=8",
                              "trainer.num_workers=8")
    with pytest.raises(PlanError, match=r"the run cannot be placed: needs \d+ CPUs; the cluster has 4 CPUs"):
        run_pipeline(config)
    assert_nothing_started(before_history, before_processes)
