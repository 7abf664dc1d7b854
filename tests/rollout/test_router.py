"""RolloutRouter over two real engines: requeued partial rollouts, a replica killed mid-batch, a
lost result, a hung replica, vLLM's engine dying during a weight update, and no engine left; and
start-up errors named before anything runs.

The module's two replicas are shared and the fault tests run in file order: replica 1 may restart
once (the kill test uses it), replica 0 may not, so the hang and engine-death tests end each
replica for good without paying for a restart."""

from __future__ import annotations

import os
import re
import signal
import time

import psutil
import pytest
from conftest import actor_gone
from rollout_helpers import collect, perturb_and_send, prompts, reference_greedy, wait_until_generating

from rlactors.config import RolloutConfig, SamplingConfig

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

NUM_TOKENS = 150


@pytest.fixture(scope="module")
def router(ray_session, tiny_model_dir):
    import ray

    from rlactors.rollout.engine import create_engine
    from rlactors.rollout.router import RolloutRouter

    config = RolloutConfig(num_engines=2, partial_rollout=True, on_abort="requeue", max_model_len=256)
    router = RolloutRouter([create_engine(str(tiny_model_dir), config, max_restarts=restarts) for restarts in (0, 1)])
    assert [h["state"] for h in router.ready()] == ["healthy", "healthy"]
    yield router
    for engine in router.engines:
        ray.kill(engine)


def long_sampling(seed=None):
    return SamplingConfig(num_samples_per_prompt=2, max_response_tokens=NUM_TOKENS, ignore_eos=True, seed=seed)


def test_requeue_restarts_interrupted_responses_under_new_weights(router, reference):
    import ray

    model, tokenizer = reference
    requests = prompts(tokenizer, [f"q{i}?" for i in range(12)])
    stream = router.generate(requests, long_sampling(seed=5))
    wait_until_generating(router.engines[0])  # the update comes mid-response, however loaded the machine
    perturb_and_send(router, model, policy_version=1, seed=11)
    groups = list(stream)

    assert sorted(g.prompt_id for g in groups) == sorted(r.prompt_id for r in requests)
    for group in groups:
        for sample in group.samples:
            assert sample.finish_reason == "length" and sample.num_response_tokens == NUM_TOKENS
            assert len(set(sample.token_policy_versions)) == 1  # requeued: restarted, never mixed
    interrupted = sum(ray.get(engine.health.remote())["num_interrupted"] for engine in router.engines)
    assert interrupted > 0
    assert any(s.token_policy_versions[0] == 1 for g in groups for s in g.samples)


def test_killed_replica_requests_are_resent_and_it_restarts_with_current_weights(router, reference):
    import ray

    model, tokenizer = reference
    perturb_and_send(router, model, policy_version=2, seed=12)
    requests = prompts(tokenizer, [f"item {i}:" for i in range(16)], prefix="k")
    stream = router.generate(requests, long_sampling())
    victim = router.engines[1]
    # As in a run on engines kept from another (`new_run`): the restarted replica, constructed with
    # the settings it first started with, is handed this run's.
    started = ray.get(victim.__ray_call__.remote(lambda self: self.config), timeout=60)
    router.replicas.run_settings = started.model_copy(update={"stall_timeout_s": started.stall_timeout_s + 1})
    wait_until_generating(victim)
    ray.kill(victim, no_restart=False)  # Ray restarts it (max_restarts=1)
    groups = list(stream)
    print(f"batch done after the kill; replica states {router.health()}")

    returned = [g.prompt_id for g in groups]
    assert sorted(returned) == sorted(r.prompt_id for r in requests)  # each prompt exactly once
    assert all(s.error is None and s.num_response_tokens == NUM_TOKENS for g in groups for s in g.samples)
    assert all(s.token_policy_versions == [2] * NUM_TOKENS for g in groups for s in g.samples)
    assert router.num_resent > 0
    assert router.health()[1]["num_failures"] == 1

    assert [h["state"] for h in router.wait_until_healthy(timeout_s=600)] == ["healthy", "healthy"]
    assert ray.get(victim.health.remote())["policy_version"] == 2
    assert ray.get(victim.__ray_call__.remote(lambda self: self.config), timeout=60) == router.replicas.run_settings
    # The restarted replica generates with the current weights, not the checkpoint it started from.
    greedy = SamplingConfig(num_samples_per_prompt=1, temperature=0.0, max_response_tokens=16, ignore_eos=True)
    texts = ["12+34=", "hello"]
    for engine in router.engines:
        groups = {g.prompt_id: g for g in collect(engine, prompts(tokenizer, texts), greedy)}
        for i, text in enumerate(texts):
            assert groups[f"p{i}"].samples[0].response_token_ids == reference_greedy(model, tokenizer.encode(text), 16)


def test_a_lost_result_fails_its_replica_and_its_requests_are_resent(router, reference, monkeypatch):
    """An ObjectLostError reading one summary (what a lost node or object store gives): the
    replica counts a failure, its unanswered requests are re-sent, each prompt comes back once,
    and the (still living) replica is taken back after a weight reload."""
    import ray

    from rlactors.rollout import stream as generation_stream

    _, tokenizer = reference
    read = generation_stream.read_item
    lost = []

    def read_losing_the_first_summary(stream, unconfirmed, timeout_s):
        confirmed = read(stream, unconfirmed, timeout_s)
        if confirmed is not None and not lost:
            lost.append(confirmed[0].prompt_id)
            raise ray.exceptions.ObjectLostError(confirmed[1].hex(), None, "")
        return confirmed

    monkeypatch.setattr(generation_stream, "read_item", read_losing_the_first_summary)
    failures_before = [h["num_failures"] for h in router.health()]
    resent_before = router.num_resent
    requests = prompts(tokenizer, [f"lost {i}:" for i in range(8)], prefix="l")
    groups = list(router.generate(requests, long_sampling()))

    assert lost, "no summary was read"
    assert sorted(g.prompt_id for g in groups) == sorted(r.prompt_id for r in requests)
    assert all(s.error is None and s.num_response_tokens == NUM_TOKENS for g in groups for s in g.samples)
    assert router.num_resent > resent_before
    health = router.wait_until_healthy(timeout_s=120)
    failed = [h for h, before in zip(health, failures_before, strict=True) if h["num_failures"] == before + 1]
    assert len(failed) == 1 and "could not be read" in failed[0]["last_error"], health
    assert [h["state"] for h in health] == ["healthy", "healthy"]


def test_a_hung_replica_is_killed_and_a_busy_one_is_left_alone(router, reference, monkeypatch):
    """Replica 1 stopped (SIGSTOP) mid-batch yields nothing and cannot answer health(): the
    watchdog kills it (its one restart is spent: it stays dead) and re-sends its requests to
    replica 0, which is asked health() at every look (no quiet time allowed) while it generates,
    answers each time, and finishes them."""
    import ray

    _, tokenizer = reference
    monkeypatch.setattr(router, "stall_timeout_s", 0.0)
    monkeypatch.setattr(router, "health_timeout_s", 10.0)
    probes_before = router.num_health_probes
    requests = prompts(tokenizer, [f"hang {i}:" for i in range(12)], prefix="h")
    stream = router.generate(requests, long_sampling())
    victim = router.engines[1]
    wait_until_generating(victim)
    pid = ray.get(victim.health.remote(), timeout=60)["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        groups = list(stream)
    finally:
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGCONT)  # the kill lands on a stopped process too; this is for a failed test

    assert sorted(g.prompt_id for g in groups) == sorted(r.prompt_id for r in requests)
    assert all(s.error is None and s.num_response_tokens == NUM_TOKENS for g in groups for s in g.samples)
    assert router.num_health_probes >= probes_before + 3  # the victim once, replica 0 over and over
    health = router.wait_until_healthy(timeout_s=120)
    assert health[1]["state"] == "dead" and "hung" in health[1]["last_error"], health
    assert health[0]["state"] == "healthy", health


def test_engine_death_during_a_weight_update_fails_the_replica_then_no_engine_is_left(router, reference):
    """vLLM's engine core of replica 0 killed: the weight update gets EngineDeadError from it, the
    router kills the actor (no restarts: it is dead) and goes on; the next batch, with no replica
    left, raises NoLiveEngineError naming each replica, its state and its last error."""
    import ray

    from rlactors.rollout.router import NoLiveEngineError

    model, tokenizer = reference
    engine = router.engines[0]
    failures_before = [h["num_failures"] for h in router.health()]
    actor_pid = ray.get(engine.health.remote(), timeout=60)["pid"]
    cores = [p for p in psutil.Process(actor_pid).children(recursive=True)
             if any("EngineCore" in part for part in p.cmdline())]
    assert cores, "no engine-core process found"
    for core in cores:
        core.kill()
    for _ in range(600):  # vLLM notices within about a second
        if not ray.get(engine.health.remote(), timeout=60)["healthy"]:
            break
        time.sleep(0.1)
    stats, _ = perturb_and_send(router, model, policy_version=3, seed=13)
    assert stats["synced"] == [] and sorted(stats["failed"]) == [0], stats  # replica 1 is dead already
    health = router.wait_until_healthy(timeout_s=120)
    assert health[0]["state"] == "dead" and health[0]["num_failures"] == failures_before[0] + 1, health
    assert "EngineDeadError" in health[0]["last_error"], health

    with pytest.raises(NoLiveEngineError) as raised:
        list(router.generate(prompts(tokenizer, ["none left"], prefix="n"), long_sampling()))
    message = str(raised.value)
    for index, failures in enumerate(failures_before):
        assert f"replica {index}: dead, {failures + (index == 0)} failure(s), last error: " in message, message
    for text in ("EngineDeadError", "hung", "prompt_ids ['n0']"):
        assert text in message, message


def test_no_live_engine_is_an_error_naming_each_replica(ray_session, tiny_model_dir):
    """Engine actors killed before any request (no restarts, vLLM never started)."""
    import ray

    from rlactors.rollout.engine import create_engine
    from rlactors.rollout.router import NoLiveEngineError, RolloutRouter
    from rlactors.types import PromptRequest

    engines = [create_engine(str(tiny_model_dir), RolloutConfig(num_cpus_per_engine=0.1)) for _ in range(2)]
    for engine in engines:
        ray.kill(engine)
    router = RolloutRouter(engines)
    with pytest.raises(NoLiveEngineError) as raised:
        list(router.generate_refs([PromptRequest(f"p{i}", [1, 2, 3]) for i in range(3)]))
    message = str(raised.value)
    assert "3 request(s) unanswered (prompt_ids ['p0', 'p1', 'p2'])" in message, message
    for index in (0, 1):
        assert re.search(rf"replica {index}: dead, 1 failure\(s\), last error: .+; then the restart failed: ", message), message
    assert "ray.kill" in message or "died" in message, message


def test_a_vllm_start_error_is_raised_by_ready_with_vllm_s_message(ray_session, tiny_model_dir):
    from rlactors.rollout.router import EngineStartError, RolloutRouter

    router = RolloutRouter.create(str(tiny_model_dir), RolloutConfig(max_model_len=4096, num_cpus_per_engine=0.1))
    with pytest.raises(EngineStartError) as raised:
        router.ready()
    message = str(raised.value)
    assert message.startswith("1 of 1 rollout engine(s) failed to start:\n  replica 0: "), message
    assert "max_model_len (4096)" in message and "1024" in message, message
    assert "Traceback" not in message and len(message.splitlines()) < 20, message
    assert actor_gone(router.engines[0], timeout_s=60)  # the engines are ended (ray.kill lands asynchronously)


def test_an_engine_that_never_starts_is_named_with_the_bound(ray_session, tiny_model_dir):
    """An actor Ray cannot place (more CPUs than the cluster has) never answers ready()."""
    from rlactors.rollout.router import EngineStartError, RolloutRouter

    config = RolloutConfig(num_cpus_per_engine=64, start_timeout_s=2)
    router = RolloutRouter.create(str(tiny_model_dir), config)
    with pytest.raises(EngineStartError, match=r"replica 0: did not start within 2 s \(rollout.start_timeout_s\)"):
        router.ready()
