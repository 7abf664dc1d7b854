"""Rollout engines killed under a running pipeline (tiny model, real stack).

- async, partial rollouts: the only engine SIGKILLed mid-generation right after a weight sync,
  the next sync arriving while it restarts: Ray restarts it, the router re-sends its requests and
  reloads the current weights, and the run trains every step on a full batch, each prompt once,
  within the staleness bound, leaving nothing behind;
- colocated: the only engine killed twice (it has one restart): the run stops with
  NoLiveEngineError naming the replica, and leaves nothing behind;
- two nodes (`ray.cluster_utils.Cluster`), a router over one engine on each: the node of one is
  removed mid-batch; every prompt comes back once from the other, and the lost replica is dead
  with its node's death as its error.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
from chaos_helpers import assert_each_prompt_once, assert_no_leftovers, checkpoint_ledger, leftover_processes
from tiny_runs import tiny_config

from rlactors.pipelines import run_pipeline

# Engines killed: each scenario pays for its own (a colocated engine killed mid-run is in make test:
# tests/pipelines/test_pipelines.py; the router's part of each at its level: tests/rollout/test_router.py).
# In make test: killed, hung and lost replicas under the router (tests/rollout/test_router.py), a crash
# mid-sync (tests/weight_sync/test_transports.py), a run with a crashed engine (tests/pipelines/test_pipelines.py).
pytestmark = [pytest.mark.vllm, pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(900)]

BATCH, NUM_STEPS = 4, 2  # tiny_config's pipeline.batch_size_prompts
RESPONSE_TOKENS = 40  # long enough that a kill while samples are in flight lands before they finish
IN_FLIGHT_WAIT_S = 120.0  # after a weight publish the producer generates the next batch at once


def _config(tmp_path, tiny_model_dir, *overrides):
    return tiny_config(tmp_path, tiny_model_dir, "data.num_train_rows=32", "data.num_val_rows=4",
                       "rollout.max_model_len=96", f"rollout.sampling.max_response_tokens={RESPONSE_TOKENS}",
                       "rollout.sampling.ignore_eos=true", f"pipeline.num_steps={NUM_STEPS}",
                       f"pipeline.checkpoint_every_steps={NUM_STEPS}", *overrides)


def _capture_routers(monkeypatch) -> list:
    from rlactors.rollout.router import RolloutRouter

    routers = []
    create = RolloutRouter.create.__func__
    monkeypatch.setattr(RolloutRouter, "create", classmethod(
        lambda cls, *args, **kwargs: routers.append(create(cls, *args, **kwargs)) or routers[-1]))
    return routers


def _engine_health(router, must_be_generating: bool) -> dict:
    """Replica 0's health() (if `must_be_generating`, once it has samples in flight)."""
    import ray

    deadline = time.monotonic() + IN_FLIGHT_WAIT_S
    while True:
        health = ray.get(router.engines[0].health.remote(), timeout=60)
        if not must_be_generating or health["num_in_flight_samples"] > 0:
            return health
        assert time.monotonic() < deadline, f"the engine had nothing in flight for {IN_FLIGHT_WAIT_S:g} s"
        time.sleep(0.01)


def _sigkill_engine(router, must_be_generating: bool = False) -> int:
    """SIGKILL replica 0's actor process (if `must_be_generating`, once it has samples in flight);
    returns its pid."""
    health = _engine_health(router, must_be_generating)
    os.kill(health["pid"], signal.SIGKILL)
    return health["pid"]


def _pid_once_back(engine, timeout_s: float = 300.0) -> int:
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(engine.health.remote(), timeout=60)["pid"]
        except ray.exceptions.ActorUnavailableError:
            assert time.monotonic() < deadline, f"the engine did not come back within {timeout_s:g} s"
            time.sleep(0.5)


def test_engine_sigkilled_mid_step_in_async_mode_with_partial_rollouts(ray_session, tmp_path, tiny_model_dir,
                                                                       monkeypatch):
    """Killed right after the first weight sync, once the producer generates under the new weights
    (at the sync itself the buffer is full, with nothing in flight; the trainer's ack after the
    publish makes room); the next sync comes while the actor restarts, so the trainer thread
    publishes while the producer thread's streams fail and wait for the revival."""
    from rlactors.pipelines.fully_async import Producer

    routers = _capture_routers(monkeypatch)
    on_published = Producer.on_published
    killed, later_pids, killers = [], [], []

    def on_published_then_engine_killed(producer, policy_version):
        on_published(producer, policy_version)
        if policy_version == 1:  # from another thread: the generation it waits for starts after the ack
            killers.append(threading.Thread(
                target=lambda: killed.append(_sigkill_engine(routers[0], must_be_generating=True))))
            killers[-1].start()
        elif policy_version > 1:
            later_pids.append(_pid_once_back(routers[0].engines[0]))

    monkeypatch.setattr(Producer, "on_published", on_published_then_engine_killed)
    before = leftover_processes()
    config = _config(tmp_path, tiny_model_dir, "pipeline.mode=async", "rollout.partial_rollout=true",
                     "buffer.max_staleness=1", "buffer.staleness_threshold=1.0", "algorithm.rollout_correction.importance_level=token")
    history = run_pipeline(config)
    for killer in killers:
        killer.join(timeout=IN_FLIGHT_WAIT_S)

    assert killed, "the engine was never killed"
    router = routers[0]
    print(f"engine pid {killed[0]} killed; replicas {router.health()}; {router.num_resent} requests re-sent")
    assert [h["step"] for h in history] == [0, *range(1, NUM_STEPS + 1)]
    assert all(h["response_length/mean"] == RESPONSE_TOKENS for h in history[1:])  # full batches, full responses
    assert history[-1]["policy_version"] == NUM_STEPS
    assert max(h["staleness/max"] for h in history[1:]) <= 1
    assert router.num_resent > 0
    # Ray restarted the actor, and the router counted the failure once although both threads met it.
    assert router.health()[0]["state"] == "healthy" and router.health()[0]["num_failures"] == 1, router.health()
    assert later_pids and killed[0] not in later_pids, (killed, later_pids)
    counts = assert_each_prompt_once(checkpoint_ledger(config.pipeline.output_dir))
    assert counts["trained"] == NUM_STEPS * BATCH, counts
    assert_no_leftovers(before)


def _stop_engine_core(router, stopped: list, must_be_generating: bool = True) -> None:
    """SIGSTOP replica 0's vLLM engine-core process (if `must_be_generating`, once it has samples
    in flight): its actor still answers everything, its core nothing. Appends (pid,
    time.monotonic()) to `stopped`."""
    import psutil

    health = _engine_health(router, must_be_generating)
    (core,) = [p for p in psutil.Process(health["pid"]).children() if "EngineCore" in p.name()]
    core.suspend()
    stopped.append((core.pid, time.monotonic()))


@pytest.mark.parametrize("when", ["generating", "at a weight sync"])
def test_engine_core_stopped_in_async_mode_is_found_restarted_and_the_run_finishes(
        ray_session, tmp_path, tiny_model_dir, monkeypatch, when):
    """vLLM's engine core SIGSTOPped after the second weight sync, mid-generation, or as the third
    sync begins (the actor around it answers health() and every call; its weight update waits on
    the core, and the engine reads as paused, never stalled): the core's silence is found within
    stall_timeout_s + health_timeout_s, by the router's watchdog or by the weight sync, whichever
    meets it first; the replica is killed and restarted with the current weights, and the run
    trains all its steps, each prompt once. (In make test: the engine's heartbeat over a silent
    stand-in core, tests/rollout/test_engine_core.py; the watchdog's kill of an unhealthy
    replica, tests/rollout/test_router.py.)"""
    from rlactors.pipelines.fully_async import Producer
    from rlactors.rollout.replicas import Replicas
    from rlactors.rollout.router import RolloutRouter

    routers = _capture_routers(monkeypatch)
    on_published, mark_failed = Producer.on_published, Replicas.mark_failed
    weight_sync_targets = RolloutRouter.weight_sync_targets
    stopped, failed, stoppers = [], [], []

    def on_published_then_core_stopped(producer, policy_version):
        on_published(producer, policy_version)
        if policy_version == 2 and when == "generating":
            stoppers.append(threading.Thread(target=_stop_engine_core, args=(routers[0], stopped)))
            stoppers[-1].start()

    def targets_then_core_stopped(router, policy_version):
        targets = weight_sync_targets(router, policy_version)
        if policy_version == 3 and when == "at a weight sync":
            _stop_engine_core(router, stopped, must_be_generating=False)
        return targets

    def recording(replicas, index, reason, *args, **kwargs):
        counted = mark_failed(replicas, index, reason, *args, **kwargs)
        if counted:  # both threads may meet the failure; the router counts it once
            failed.append((time.monotonic(), reason))
        return counted

    monkeypatch.setattr(RolloutRouter, "weight_sync_targets", targets_then_core_stopped)
    monkeypatch.setattr(Producer, "on_published", on_published_then_core_stopped)
    monkeypatch.setattr(Replicas, "mark_failed", recording)
    before = leftover_processes()
    stall_timeout_s, health_timeout_s = 20.0, 10.0
    config = _config(tmp_path, tiny_model_dir, "pipeline.mode=async", "pipeline.num_steps=4",
                     f"rollout.stall_timeout_s={stall_timeout_s}", f"rollout.health_timeout_s={health_timeout_s}")
    history = run_pipeline(config)
    for stopper in stoppers:
        stopper.join(timeout=IN_FLIGHT_WAIT_S)

    assert stopped, "the engine core was never stopped"
    (core_pid, stopped_at), router = stopped[0], routers[0]
    print(f"engine core {core_pid} stopped; failures {failed}; replicas {router.health()}")
    assert [h["step"] for h in history] == [0, 1, 2, 3, 4]
    assert len(failed) == 1 and "hung" in failed[0][1], failed
    # Found within the bound (plus the watchdog's and the heartbeat's polling, on a loaded machine).
    assert failed[0][0] - stopped_at <= stall_timeout_s + health_timeout_s + 10.0, failed[0][0] - stopped_at
    assert router.health()[0]["state"] == "healthy" and router.health()[0]["num_failures"] == 1, router.health()
    counts = assert_each_prompt_once(checkpoint_ledger(config.pipeline.output_dir))
    assert counts["trained"] == 4 * BATCH, counts
    assert_no_leftovers(before)  # the stopped core went with its actor


def test_an_async_run_whose_rollout_stops_delivering_ends_within_the_batch_timeout_naming_each_side(
        ray_session, tmp_path, tiny_model_dir, monkeypatch):
    """The engine core stopped after the first weight sync, with the watchdog and the heartbeat set
    too slow to see it within the run (whatever else could keep the producer from putting): the
    trainer's wait for a batch ends after pipeline.batch_timeout_s without a put, in one error
    saying what the producer, the buffer and the replica were doing, and the run leaves nothing
    behind. (In make test: the same wait over the real buffer, tests/pipelines/test_producer.py.)"""
    from rlactors.pipelines.fully_async import Producer

    routers = _capture_routers(monkeypatch)
    on_published = Producer.on_published
    stopped, stoppers = [], []

    def on_published_then_core_stopped(producer, policy_version):
        on_published(producer, policy_version)
        if policy_version == 1:
            stoppers.append(threading.Thread(target=_stop_engine_core, args=(routers[0], stopped)))
            stoppers[-1].start()

    monkeypatch.setattr(Producer, "on_published", on_published_then_core_stopped)
    before = leftover_processes()
    config = _config(tmp_path, tiny_model_dir, "pipeline.mode=async", "pipeline.num_steps=4",
                     "rollout.stall_timeout_s=600", "rollout.health_timeout_s=600", "pipeline.batch_timeout_s=15")
    with pytest.raises(TimeoutError) as raised:
        run_pipeline(config)
    for stopper in stoppers:
        stopper.join(timeout=IN_FLIGHT_WAIT_S)

    assert stopped, "the engine core was never stopped"
    message = str(raised.value)
    print(message)
    for text in ("no group reached the replay buffer for 15 s (pipeline.batch_timeout_s)", "Producer: generating",
                 "Buffer since the last batch: ", "reserved (in flight)", "Rollout: replica 0 healthy"):
        assert text in message, message
    assert_no_leftovers(before)  # the stopped core went with its actor


@pytest.mark.extended  # the router out of replicas, naming each: tests/rollout/test_router.py
def test_the_only_engine_killed_twice_stops_the_run_naming_it(ray_session, tmp_path, tiny_model_dir, monkeypatch):
    """Killed once after it started (Ray restarts it; the first generation waits for it, or meets
    the restarted actor), then at the first weight sync (no restart left): the next generation
    raises NoLiveEngineError."""
    from rlactors.rollout.router import NoLiveEngineError, RolloutRouter

    routers = _capture_routers(monkeypatch)
    ready, weight_sync_targets = RolloutRouter.ready, RolloutRouter.weight_sync_targets
    killed = []

    def ready_then_killed(router):
        health = ready(router)
        killed.append(_sigkill_engine(router))
        return health

    def targets_then_the_engine_killed(router, policy_version):
        if len(killed) == 1:
            router.wait_until_healthy(timeout_s=300)  # the restarted actor, not the one being restarted
        targets = weight_sync_targets(router, policy_version)
        if len(killed) == 1:  # the trainer's sync then runs into the dead engine
            killed.append(_sigkill_engine(router))
        return targets

    monkeypatch.setattr(RolloutRouter, "ready", ready_then_killed)
    monkeypatch.setattr(RolloutRouter, "weight_sync_targets", targets_then_the_engine_killed)
    before = leftover_processes()
    with pytest.raises(NoLiveEngineError) as raised:
        run_pipeline(_config(tmp_path, tiny_model_dir))

    assert len(killed) == 2 and killed[0] != killed[1], killed
    message = str(raised.value)
    print(message)
    assert re.search(r"replica 0: dead, [12] failure\(s\), last error: .+; then the restart failed: ", message), message
    assert [h["state"] for h in routers[0].health()] == ["dead"]
    assert_no_leftovers(before)


def test_a_node_removed_under_its_engine(ray_session, tiny_model_dir):
    import ray
    from conftest import another_ray

    from rlactors.config import RolloutConfig, SamplingConfig
    from rlactors.models import load_tokenizer
    from rlactors.rollout.engine import create_engine
    from rlactors.rollout.router import RolloutRouter
    from rlactors.types import PromptRequest

    nodes = [{"num_cpus": 2, "resources": {name: 1}, "object_store_memory": 1 << 29} for name in ("kept", "doomed")]
    with another_ray(nodes) as cluster:
        doomed = cluster.list_all_nodes()[1]
        before = leftover_processes()
        config = RolloutConfig(max_model_len=256, num_cpus_per_engine=1)
        router = RolloutRouter([create_engine(str(tiny_model_dir), config, resources={node: 0.5})
                                for node in ("kept", "doomed")])
        router.ready()
        tokenizer = load_tokenizer(tiny_model_dir)
        requests = [PromptRequest(f"n{i}", tokenizer.encode(f"node {i}:")) for i in range(12)]
        sampling = SamplingConfig(num_samples_per_prompt=2, max_response_tokens=150, ignore_eos=True)
        stream = router.generate(requests, sampling)  # sent to both engines from here on
        deadline = time.monotonic() + 120
        while ray.get(router.engines[1].health.remote(), timeout=60)["num_in_flight_samples"] == 0:
            assert time.monotonic() < deadline, "the doomed node's engine never generated"
            time.sleep(0.02)
        cluster.remove_node(doomed)
        groups = list(stream)

        assert sorted(g.prompt_id for g in groups) == sorted(r.prompt_id for r in requests)
        assert all(s.error is None and s.num_response_tokens == 150 for g in groups for s in g.samples)
        assert router.num_resent > 0
        health = router.wait_until_healthy(timeout_s=120)
        print(health)
        assert health[0]["state"] == "healthy" and health[1]["state"] == "dead", health
        assert "node" in health[1]["last_error"], health
        for engine in router.engines:
            ray.kill(engine)
        assert_no_leftovers(before)
