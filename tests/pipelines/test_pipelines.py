"""Both drivers through the real stack (Ray, vLLM, FSDP2, reward actors, buffer) on the tiny model:
what a run reports, engines kept from one run to the next, an exact resume, an engine crash, what
reaches the driver, async equal to colocated on-policy, and the staleness bound with partial rollouts.

Two identical colocated runs of 3 steps are shared by the module: `first` starts its engines and
keeps them (`rlactors.pipelines.warm`), `second` takes them. Later runs take them too where their
engine settings match; each mode's first run starts its own.
"""

import importlib.util
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from tiny_runs import STEP_METRICS, computed, tiny_config, with_resume

from rlactors.pipelines import run_pipeline

pytestmark = pytest.mark.vllm

NUM_STEPS = 3
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _engine_identity(warm) -> list[tuple[str, int]]:
    """The kept engines' and trainer ranks' actor ids and processes."""
    import ray

    ranks = [(worker._actor_id.hex(), info["pid"]) for group in warm.kept.trainers.values()
             for worker, info in zip(group.workers, group.info, strict=True)]  # info: from setup or start_run
    return [(engine._actor_id.hex(), ray.get(engine.health.remote(), timeout=60)["pid"])
            for engine in warm.kept.engines] + ranks


@pytest.fixture(scope="module")
def first(warm_actors, tiny_model_dir, tmp_path_factory):
    """3 colocated steps, a checkpoint at step 2; its engines started here and kept after."""
    warm_actors.close()
    config = tiny_config(tmp_path_factory.mktemp("first"), tiny_model_dir, f"pipeline.num_steps={NUM_STEPS}",
                         "pipeline.checkpoint_every_steps=2")
    history = run_pipeline(config, warm=warm_actors)
    return config, history, _engine_identity(warm_actors)


@pytest.fixture(scope="module")
def second(first, warm_actors, tmp_path_factory):
    """The same run in another folder, on the engines and trainer ranks `first` kept."""
    config = first[0].model_copy(deep=True)
    config.pipeline.output_dir = str(tmp_path_factory.mktemp("second") / "run")
    num_taken, num_trainers_taken = warm_actors.num_taken, warm_actors.num_trainers_taken
    history = run_pipeline(config, warm=warm_actors)
    assert warm_actors.num_taken == num_taken + 1, "the second run started engines of its own"
    assert warm_actors.num_trainers_taken == num_trainers_taken + 1, "the second run started trainer ranks of its own"
    return config, history, _engine_identity(warm_actors)


def test_a_colocated_run_reports_every_step(first):
    config, history, _ = first
    assert [h["step"] for h in history] == list(range(NUM_STEPS + 1))
    for name in STEP_METRICS + ["val/synthetic/arithmetic/acc"]:
        assert name in history[-1], name
    assert history[-1]["policy_version"] == NUM_STEPS
    assert max(h["staleness/max"] for h in history[1:]) == 0  # colocated is strictly on-policy
    output_dir = Path(config.pipeline.output_dir)
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(NUM_STEPS + 1))
    assert (output_dir / "metrics.png").stat().st_size > 0
    assert (output_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"


def test_a_run_on_kept_engines_and_trainers_trains_exactly_like_one_that_started_them(first, second):
    """The same vLLM processes and trainer ranks served both runs, and every computed metric of
    every step repeats: the taken engines generated with the second run's weights from its first
    token on, and the taken ranks trained from the model folder with a fresh optimizer."""
    (_, started, engines), (_, taken, same_engines) = first, second
    assert same_engines == engines
    assert [computed(step) for step in taken] == [computed(step) for step in started]
    assert taken[1]["reward/mean"] != taken[2]["reward/mean"] or taken[1]["actor/pg_loss"] != 0


def test_kept_engines_start_the_next_run_at_version_0_and_refuse_to_generate_before_its_weights(second,
                                                                                              warm_actors):
    import ray

    from rlactors.types import PromptRequest

    engine = warm_actors.kept.engines[0]
    health = ray.get(engine.health.remote(), timeout=60)
    assert health["policy_version"] == NUM_STEPS and health["asleep"]  # kept asleep, as the run left them
    ray.get(engine.new_run.remote(), timeout=60)
    assert ray.get(engine.health.remote(), timeout=60)["policy_version"] == 0
    assert ray.get(engine.phase_log.remote(), timeout=60) == []
    ray.get(engine.wake_up.remote(), timeout=60)
    with pytest.raises(ray.exceptions.RayTaskError, match="holds the last run's weights"):
        ray.get(next(engine.generate.remote([PromptRequest("p", [5, 6])])), timeout=60)
    ray.get(engine.sleep.remote(), timeout=60)  # as kept: the next run sends its weights, then wakes it


def test_a_resumed_run_reproduces_the_next_step_exactly(first, second, warm_actors):
    """From the second run's checkpoint at step 2: step 3 equals both uninterrupted runs' step 3.
    The resumed run holds nothing but the checkpoint: its trainer ranks load the model folder and a
    fresh optimizer before the checkpoint, and its engines get the checkpoint's weights. A driver
    SIGKILLed after (and during) a checkpoint, then resumed: tests/chaos/test_checkpoint_faults.py."""
    config, uninterrupted, _ = second
    resumed = run_pipeline(with_resume(config), warm=warm_actors)
    assert [h["step"] for h in resumed] == [NUM_STEPS]
    for name in ("reward/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert resumed[0][name] == pytest.approx(uninterrupted[NUM_STEPS][name], rel=1e-5, abs=1e-6), name
        assert resumed[0][name] == pytest.approx(first[1][NUM_STEPS][name], rel=1e-5, abs=1e-6), name


def test_no_rollout_data_reaches_the_driver(warm_actors, tmp_path, tiny_model_dir, monkeypatch):
    """Two colocated steps with every byte the driver process receives counted (`DriverBytes`):
    no Group, Sample, TrainBatch or tensor comes back by value, no engine, scorer or trainer
    result arrives inline, and all it receives is a fraction of the rollout bytes (the trained
    Groups' serialized size; the old path received every Group twice, over 2x)."""
    from rlactors.pipelines import colocated

    spec = importlib.util.spec_from_file_location("received_bytes", BENCHMARKS / "received_bytes.py")
    received_bytes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(received_bytes)  # the benchmarks' counter, a measurement tool outside the package
    DriverBytes, object_size = received_bytes.DriverBytes, received_bytes.object_size

    rollout_bytes = []
    prepare = colocated.prepare_batch

    def prepare_sized(run, sampled):
        rollout_bytes.append(object_size(sampled.groups_ref))
        return prepare(run, sampled)

    monkeypatch.setattr(colocated, "prepare_batch", prepare_sized)
    config = tiny_config(tmp_path, tiny_model_dir, "rollout.sampling.max_response_tokens=128", "rollout.sampling.ignore_eos=true")
    with DriverBytes() as received:
        history = run_pipeline(config, warm=warm_actors)
    assert [h["step"] for h in history] == [0, 1, 2] and history[-1]["response_length/mean"] == 128
    print(f"driver received {dict(received.total)} for rollouts of {rollout_bytes} bytes; "
          f"by source {dict(received.bytes_by_source.most_common())}")
    assert not received.rollout_types_read, received.rollout_types_read
    inline_calls = {source for source in received.bytes_by_source if source.startswith("inline ")}
    assert not inline_calls & {"inline streamed item", "inline score", "inline compute_logprobs", "inline update_policy"}
    assert received.largest_read[0] < 8192, received.largest_read
    assert received.total["bytes"] < 0.5 * sum(rollout_bytes)  # setup and both validations included


def test_run_survives_a_crashed_rollout_engine(warm_actors, tmp_path, tiny_model_dir, monkeypatch):
    """SIGKILL the engine process mid-run: Ray restarts it, the router reloads the current weights
    and re-sends its prompts, and every step still trains a full batch. (The engine the run took is
    not kept after: its restart is spent.)"""
    from rlactors.rollout.router import RolloutRouter

    routers = []
    over = RolloutRouter.over.__func__  # every router of a run: over the engines it started or took
    monkeypatch.setattr(RolloutRouter, "over", classmethod(lambda cls, *a, **k: routers.append(over(cls, *a, **k))
                                                           or routers[-1]))
    config = tiny_config(tmp_path, tiny_model_dir, "pipeline.num_steps=4")
    metrics_file = Path(config.pipeline.output_dir) / "metrics.jsonl"
    killed = []

    def kill_engine_after_first_step():
        import ray

        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not killed:
            if routers and metrics_file.is_file() and len(metrics_file.read_text().splitlines()) >= 2:
                pid = ray.get(routers[0].engines[0].health.remote())["pid"]
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.05)

    killer = threading.Thread(target=kill_engine_after_first_step, daemon=True)
    killer.start()
    history = run_pipeline(config, warm=warm_actors)
    killer.join(timeout=5)
    assert killed, "the engine was never killed"
    assert [h["step"] for h in history] == [0, 1, 2, 3, 4]
    assert all(h["response_length/mean"] > 0 for h in history[1:])
    assert history[-1]["policy_version"] == 4
    assert warm_actors.kept is None  # a replica failed: nothing kept


ASYNC = ["pipeline.mode=async", "rollout.partial_rollout=true"]


def test_async_equals_colocated_when_strictly_on_policy(first, warm_actors, tmp_path, tiny_model_dir):
    """No staleness allowed: the producer waits for each publish, so nothing is interrupted and the
    async run trains the colocated run's batches."""
    fully_async = run_pipeline(tiny_config(tmp_path, tiny_model_dir, *ASYNC, "buffer.max_staleness=0",
                                           "buffer.staleness_threshold=0"), warm=warm_actors)
    colocated = first[1]
    for name in ("reward/mean", "response_length/mean", "actor/pg_loss", "actor/ppo_kl", "actor/grad_norm",
                 "actor/entropy"):
        for step in (1, 2):
            assert fully_async[step][name] == pytest.approx(colocated[step][name], rel=1e-5, abs=1e-6), (name, step)
    assert fully_async[-1]["staleness/max"] == 0


def test_async_with_staleness_and_partial_rollouts_keeps_the_bound(warm_actors, tmp_path, tiny_model_dir):
    history = run_pipeline(tiny_config(
        tmp_path, tiny_model_dir, *ASYNC, "pipeline.num_steps=4", "buffer.max_staleness=1",
        "buffer.staleness_threshold=1.0", "algorithm.rollout_correction.importance_level=token"), warm=warm_actors)
    assert len(history) == 5
    assert max(h["staleness/max"] for h in history[1:]) <= 1
    # The trainer acks a batch after publishing the weights it trained: what the producer starts in
    # the room the ack frees is generated under them, so no group goes stale waiting in the queue.
    assert sum(h["buffer/num_evicted_stale"] for h in history[1:]) == 0
    # Where the rollout side's time went, step by step: the engine generated, paused for each
    # publish, and its clock never counts more time than the steps took (read at each step's end).
    spent = {state: sum(h[f"timing_s/rollout_{state}"] for h in history[1:])
             for state in ("generating", "paused", "idle", "blocked")}
    assert spent["generating"] > 0 and spent["paused"] > 0, spent
    engine_s = spent["generating"] + spent["paused"] + spent["idle"]
    assert engine_s <= sum(h["timing_s/step"] for h in history[1:]) + 1.0, spent
    # How full the engine was while it generated: the streaming producer's groups, never more than it runs.
    occupancy = [h["rollout/occupancy"] for h in history[1:] if "rollout/occupancy" in h]
    assert occupancy and all(0 < share <= 1 for share in occupancy), occupancy


@pytest.mark.slow  # the per-token guarantee is in make test at the engine (rollout/test_engine.py, partial rollout)
def test_async_partial_rollouts_label_each_token_with_the_weights_that_made_it(warm_actors, tmp_path, tiny_model_dir,
                                                                               reference, monkeypatch):
    """Fully-async, a weight update every step, responses long enough to be cut by one: responses
    span versions, and each token's logprob is that of the published weights its version names
    (a transformers forward, fp32). The test `make test-vllm-oldest` runs on vLLM 0.27, whose
    outputs carry no version labels: there the engine's own accounting is all there is."""
    from tiny_runs import check_tokens_against_their_versions, record_published_weights, record_scored_batches

    published = record_published_weights(monkeypatch)
    batches = record_scored_batches(monkeypatch)
    history = run_pipeline(tiny_config(
        tmp_path, tiny_model_dir, *ASYNC, "pipeline.num_steps=3", "buffer.max_staleness=1",
        "buffer.staleness_threshold=1.0", "rollout.sampling.max_response_tokens=64",
        "rollout.sampling.ignore_eos=true"), warm=warm_actors)
    assert max(h["staleness/max"] for h in history[1:]) <= 1
    model, _ = reference
    published.setdefault(0, model.state_dict())  # engines started for the run hold the checkpoint's weights
    assert check_tokens_against_their_versions(batches, published, model), "no response spans a weight update"
