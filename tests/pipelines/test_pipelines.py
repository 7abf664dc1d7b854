"""Every driver and mode for 2 steps on the tiny model, through the real stack (Ray, vLLM,
FSDP2, reward actors, buffer). Each run starts its own engine (~35 s on 2 cores)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlactors.config import dump_config, load_config
from rlactors.pipelines import run_pipeline

pytestmark = pytest.mark.vllm

STEP_METRICS = [
    "reward/mean", "response_length/mean", "response_length/clip_ratio", "actor/ppo_kl", "actor/pg_clipfrac",
    "actor/entropy", "actor/grad_norm", "staleness/mean", "staleness/max", "timing_s/step", "timing_s/gen",
    "timing_s/update", "timing_s/weight_sync", "throughput/tokens_per_s_per_device",
]


# Varies within a group even for an untrained model, so advantages and losses are not all zero.
PARITY_REWARD = f"reward.custom_function={Path(__file__).parents[1] / 'parity_reward.py'}:compute_score"


def tiny_config(tmp_path, tiny_model_dir, *overrides):
    return load_config(None, [
        f"model.path={tiny_model_dir}", "model.preset=tiny", "data.num_train_rows=64", "data.num_val_rows=8",
        "rollout.max_model_len=64", "rollout.sampling.num_samples_per_prompt=4",
        "rollout.sampling.max_response_tokens=4", "rollout.sampling.seed=1", "rollout.validation_sampling.max_response_tokens=4",
        "pipeline.num_steps=2", "pipeline.batch_size_prompts=4", "pipeline.val_every_steps=0",
        f"pipeline.output_dir={tmp_path / 'run'}", "pipeline.resume=never", PARITY_REWARD, *overrides,
    ])


def test_colocated_grpo_two_steps(ray_session, tmp_path, tiny_model_dir):
    history = run_pipeline(tiny_config(tmp_path, tiny_model_dir))
    assert [h["step"] for h in history] == [0, 1, 2]
    for name in STEP_METRICS + ["val/synthetic/arithmetic/acc"]:
        assert name in history[-1], name
    assert history[-1]["policy_version"] == 2
    assert history[-1]["staleness/max"] == 0  # colocated is strictly on-policy
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]
    assert (tmp_path / "run" / "metrics.png").stat().st_size > 0


def test_async_equals_colocated_when_strictly_on_policy(ray_session, tmp_path, tiny_model_dir):
    colocated = run_pipeline(tiny_config(tmp_path / "c", tiny_model_dir))
    fully_async = run_pipeline(tiny_config(tmp_path / "a", tiny_model_dir, "pipeline.mode=async",
                                           "buffer.max_staleness=0", "buffer.staleness_threshold=0"))
    for name in ("reward/mean", "response_length/mean", "actor/pg_loss", "actor/ppo_kl", "actor/grad_norm",
                 "actor/entropy"):
        for step in (1, 2):
            assert fully_async[step][name] == pytest.approx(colocated[step][name], rel=1e-5, abs=1e-6), (name, step)
    assert fully_async[-1]["staleness/max"] == 0


def test_async_with_staleness_and_partial_rollouts_keeps_the_bound(ray_session, tmp_path, tiny_model_dir):
    history = run_pipeline(tiny_config(
        tmp_path, tiny_model_dir, "pipeline.mode=async", "pipeline.num_steps=3", "buffer.max_staleness=1",
        "buffer.staleness_threshold=1.0", "rollout.partial_rollout=true", "algorithm.rollout_correction.importance_level=token"))
    assert len(history) == 4
    assert max(h["staleness/max"] for h in history[1:]) <= 1


def test_resume_after_killing_the_driver_reproduces_the_next_step(ray_session, tmp_path, tiny_model_dir):
    """Kill the driver (SIGKILL) right after checkpoint 2; the resumed run's step 3 equals an
    uninterrupted run's step 3."""
    uninterrupted = run_pipeline(tiny_config(tmp_path / "u", tiny_model_dir, "pipeline.num_steps=3"))
    config = tiny_config(tmp_path / "r", tiny_model_dir, "pipeline.num_steps=6", "pipeline.checkpoint_every_steps=2")
    config_path = tmp_path / "r.yaml"
    dump_config(config, config_path)
    latest = Path(config.pipeline.output_dir) / "checkpoints" / "latest"
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    driver = subprocess.Popen([sys.executable, "-m", "rlactors", "run", str(config_path)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while not (latest.is_file() and latest.read_text().strip() == "step_00000002"):
            assert driver.poll() is None, "the driver exited before its second checkpoint"
            assert time.monotonic() < deadline, "no checkpoint 2 within 10 minutes"
            time.sleep(0.2)
        driver.send_signal(signal.SIGKILL)
    finally:
        driver.kill()
        driver.wait()
    resumed = run_pipeline(config.model_copy(update={"pipeline": config.pipeline.model_copy(
        update={"num_steps": 3, "resume": "auto"})}))
    assert [h["step"] for h in resumed] == [3]
    for name in ("reward/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert resumed[0][name] == pytest.approx(uninterrupted[3][name], rel=1e-5, abs=1e-6), name


def test_run_survives_a_crashed_rollout_engine(ray_session, tmp_path, tiny_model_dir, monkeypatch):
    """SIGKILL the engine process mid-run: Ray restarts it, the router reloads the current weights
    and re-sends its prompts, and every step still trains a full batch."""
    import threading

    from rlactors.rollout.router import RolloutRouter

    routers = []
    create = RolloutRouter.create.__func__
    monkeypatch.setattr(RolloutRouter, "create", classmethod(lambda cls, *a, **k: routers.append(create(cls, *a, **k))
                                                             or routers[-1]))
    config = tiny_config(tmp_path, tiny_model_dir, "pipeline.num_steps=4")
    metrics_file = Path(config.pipeline.output_dir) / "metrics.jsonl"
    killed = []

    def kill_engine_after_first_step():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not killed:
            if routers and metrics_file.is_file() and len(metrics_file.read_text().splitlines()) >= 2:
                pid = ray_session.get(routers[0].engines[0].health.remote())["pid"]
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.05)

    killer = threading.Thread(target=kill_engine_after_first_step, daemon=True)
    killer.start()
    history = run_pipeline(config)
    killer.join(timeout=5)
    assert killed, "the engine was never killed"
    assert [h["step"] for h in history] == [0, 1, 2, 3, 4]
    assert all(h["response_length/mean"] > 0 for h in history[1:])
    assert history[-1]["policy_version"] == 4


def test_no_rollout_data_reaches_the_driver(ray_session, tmp_path, tiny_model_dir, monkeypatch):
    """Two colocated steps with every byte the driver process receives counted (`DriverBytes`):
    no Group, Sample, TrainBatch or tensor comes back by value, no engine, scorer or trainer
    result arrives inline, and all it receives is a fraction of the rollout bytes (the trained
    Groups' serialized size; the old path received every Group twice, over 2x)."""
    from rlactors.driver_bytes import DriverBytes, object_size
    from rlactors.pipelines import colocated

    rollout_bytes = []
    prepare = colocated.prepare_batch

    def prepare_sized(run, sampled):
        rollout_bytes.append(object_size(sampled.groups_ref))
        return prepare(run, sampled)

    monkeypatch.setattr(colocated, "prepare_batch", prepare_sized)
    config = tiny_config(tmp_path, tiny_model_dir, "rollout.max_model_len=192", "rollout.sampling.max_response_tokens=128",
                         "rollout.sampling.ignore_eos=true")
    with DriverBytes() as received:
        history = run_pipeline(config)
    assert [h["step"] for h in history] == [0, 1, 2] and history[-1]["response_length/mean"] == 128
    print(f"driver received {dict(received.total)} for rollouts of {rollout_bytes} bytes; "
          f"by source {dict(received.bytes_by_source.most_common())}")
    assert not received.rollout_types_read, received.rollout_types_read
    inline_calls = {source for source in received.bytes_by_source if source.startswith("inline ")}
    assert not inline_calls & {"inline streamed item", "inline score", "inline compute_logprobs", "inline update_policy"}
    assert received.largest_read[0] < 8192, received.largest_read
    assert received.total["bytes"] < 0.5 * sum(rollout_bytes)  # setup and both validations included
