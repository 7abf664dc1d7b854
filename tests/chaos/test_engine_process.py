"""vLLM's own processes under faults: a start-up failure in vLLM's worker or front end, SIGKILL of
only the engine-core process (alone, and in a training run), SIGKILL of the engine actor.

Invariants: a start failure reaches the caller within a bound carrying vLLM's own message; a dead
engine core makes every engine call fail promptly with EngineDeadError (none hangs) and a run
carries on through it with every prompt trained once; no vLLM process outlives its engine actor.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import psutil
import pytest
import ray
from chaos_helpers import assert_each_prompt_once, assert_no_leftovers, checkpoint_ledger, leftover_processes
from conftest import another_ray
from tiny_runs import tiny_config

from rlactors.config import RolloutConfig, SamplingConfig
from rlactors.runtime.calls import get_within
from rlactors.types import PromptRequest

pytestmark = [pytest.mark.vllm, pytest.mark.chaos]

START_TIMEOUT_S = 300.0  # hang guards: an engine starts in ~35 s alone, much slower on shared cores
CALL_TIMEOUT_S = 60.0


def vllm_processes(actor_pid: int) -> list[psutil.Process]:
    """The processes an engine actor started (engine core, workers, multiprocessing's tracker)."""
    return psutil.Process(actor_pid).children(recursive=True)


def alive(processes: list[psutil.Process]) -> list[str]:
    names = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                names.append(f"{process.name()} (pid {process.pid})")
        except psutil.NoSuchProcess:
            continue
    return names


def wait_until_gone(processes: list[psutil.Process], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while alive(processes):
        assert time.monotonic() < deadline, f"{what}: still alive after {timeout_s:g} s: {alive(processes)}"
        time.sleep(0.1)


def kill_all(processes: list[psutil.Process]) -> None:
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue


def engine_core_of(actor_pid: int) -> psutil.Process:
    [core] = [p for p in vllm_processes(actor_pid) if "EngineCore" in p.name()]
    return core


def model_missing_a_tensor(tiny_model_dir, folder):
    """A copy of the tiny model whose weights file lacks `model.norm.weight`: the front end accepts it,
    vLLM's worker fails to load it (transformers only warns)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model_dir, folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


MISSING_TENSOR_ERROR = "Following weights were not initialized from checkpoint: {'model.norm.weight'}"


# ------------------------------------------------------------------ start-up failures (the suite's Ray)


@pytest.mark.extended  # the same failure, end to end through build_run, is in the slow tier (below)
def test_a_start_failure_in_vllms_worker_carries_vllms_own_message(ray_session, tmp_path, tiny_model_dir):
    from rlactors.rollout.engine import create_engine

    before = leftover_processes()
    engine = create_engine(str(model_missing_a_tensor(tiny_model_dir, tmp_path / "broken")), RolloutConfig(max_model_len=64))
    try:
        with pytest.raises(ray.exceptions.RayTaskError) as failure:
            get_within(engine.ready.remote(), START_TIMEOUT_S, "ready() of an engine whose weights lack a tensor")
        message = str(failure.value.cause)
        assert message.startswith("vLLM engine failed to start: ValueError: "), message
        assert MISSING_TENSOR_ERROR in message and "VLLM::Worker" in message, message
        assert "See root cause above" not in message
        # Every later call fails at once with the same cause; health() says why.
        with pytest.raises(ray.exceptions.RayTaskError, match="Following weights were not initialized"):
            get_within(engine.generate.remote([PromptRequest("p", [1, 2])]).__next__(), CALL_TIMEOUT_S, "generate")
        health = get_within(engine.health.remote(), CALL_TIMEOUT_S, "health")
        assert not health["healthy"] and MISSING_TENSOR_ERROR in health["error"]
        started = [p for p in vllm_processes(health["pid"]) if p.name().startswith("VLLM::")]
        assert not alive(started), "vLLM's processes outlived its failed start"
    finally:
        ray.kill(engine)
    assert_no_leftovers(before)


@pytest.mark.slow  # make test: the same refusal through the router, tests/rollout/test_router.py
def test_a_config_vllm_refuses_in_the_front_end_carries_vllms_own_message(ray_session, tiny_model_dir):
    from rlactors.rollout.engine import create_engine

    engine = create_engine(str(tiny_model_dir), RolloutConfig(max_model_len=4096))  # the model takes 1024
    try:
        with pytest.raises(ray.exceptions.RayTaskError) as failure:
            get_within(engine.ready.remote(), START_TIMEOUT_S, "ready() with a max_model_len too long")
        message = str(failure.value.cause)
        assert message.startswith("vLLM engine failed to start: ValidationError: "), message
        assert "max_model_len (4096) is greater than the derived max_model_len" in message, message
    finally:
        ray.kill(engine)


@pytest.mark.slow  # make test: a vLLM start error raised by the router's ready(), tests/rollout/test_router.py
def test_a_run_whose_engine_cannot_start_fails_before_training_with_vllms_message(ray_session, tmp_path,
                                                                                  tiny_model_dir):
    from rlactors.pipelines import run_pipeline

    broken = model_missing_a_tensor(tiny_model_dir, tmp_path / "broken")
    config = tiny_config(tmp_path, broken)
    with pytest.raises(Exception, match="Following weights were not initialized") as failure:
        run_pipeline(config)
    assert "vLLM engine failed to start" in str(failure.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "training started"


# ------------------------------------------------------------------ the engine core killed in a run


@pytest.mark.extended  # the core killed under a router: tests/rollout/test_router.py, tests/weight_sync/test_transports.py
def test_a_run_goes_on_when_only_the_engine_core_is_sigkilled(warm_actors, tmp_path, tiny_model_dir, monkeypatch):
    """Kill the engine-core process right before step 2 generates: its generate fails with
    EngineDeadError, the router restarts the replica and re-sends the prompts, every step trains
    a full batch, and nothing is left afterwards (the engine, taken from the warm ones if they
    match, is not kept: a replica failed)."""
    from rlactors.pipelines import run_pipeline
    from rlactors.rollout.router import RolloutRouter

    before = leftover_processes()
    config = tiny_config(tmp_path, tiny_model_dir, "pipeline.num_steps=3", "pipeline.checkpoint_every_steps=3")
    metrics_file = tmp_path / "run" / "metrics.jsonl"
    killed = []

    over = RolloutRouter.over.__func__  # every router of a run: over the engines it started or took

    def over_with_a_fault(cls, *args, **kwargs):
        router = over(cls, *args, **kwargs)
        generate_refs = router.generate_refs

        def kill_the_core_before_step_2(*call_args, **call_kwargs):
            if not killed and metrics_file.is_file() and len(metrics_file.read_text().splitlines()) >= 2:
                health = get_within(router.engines[0].health.remote(), CALL_TIMEOUT_S, "engine health")
                core = engine_core_of(health["pid"])
                core.send_signal(signal.SIGKILL)
                wait_until_gone([core], CALL_TIMEOUT_S, "the SIGKILLed engine core")
                killed.append(core.pid)
            return generate_refs(*call_args, **call_kwargs)

        router.generate_refs = kill_the_core_before_step_2
        return router

    monkeypatch.setattr(RolloutRouter, "over", classmethod(over_with_a_fault))
    history = run_pipeline(config, warm=warm_actors)
    assert killed, "the engine core was never killed"
    assert [h["step"] for h in history] == [0, 1, 2, 3]
    assert all(h["response_length/mean"] > 0 for h in history[1:])
    assert history[-1]["policy_version"] == 3
    counts = assert_each_prompt_once(checkpoint_ledger(tmp_path / "run"))
    assert counts["trained"] == 3 * 4 and counts["dropped"] == 0, counts  # 3 full batches of 4 prompts
    assert warm_actors.kept is None
    assert_no_leftovers(before)


# ------------------------------------------------------------------ without Ray's process-group clean-up


@pytest.fixture(scope="module")
def ray_without_group_cleanup():
    """A local Ray whose raylet does not kill a dead worker's process group (on by default in
    the Ray installed here; absent from older ones, and gone with the raylet): what outlives a
    SIGKILLed engine actor is then what the engine itself lets outlive it."""
    with another_ray(env={"RAY_process_group_cleanup_enabled": "0"}):
        yield ray


@pytest.mark.extended  # the plugin's watch, without vLLM: tests/rollout/test_vllm_plugin.py; none left: test_engine_faults.py
def test_vllm_processes_die_with_a_sigkilled_engine_actor(ray_without_group_cleanup, tiny_model_dir):
    from rlactors.rollout.engine import create_engine

    engine = create_engine(str(tiny_model_dir), RolloutConfig(max_model_len=64))
    children = []
    try:
        health = get_within(engine.ready.remote(), START_TIMEOUT_S, "engine ready")
        children = vllm_processes(health["pid"])
        names = [p.name() for p in children]
        assert "VLLM::EngineCore" in names and "VLLM::Worker" in names, names
        os.kill(health["pid"], signal.SIGKILL)
        wait_until_gone(children, CALL_TIMEOUT_S, "vLLM's processes after a SIGKILL of their engine actor")
    finally:
        ray.kill(engine)
        kill_all(children)  # only if the test failed


@pytest.mark.extended  # the core killed under a router: tests/rollout/test_router.py, tests/weight_sync/test_transports.py
def test_a_dead_engine_core_fails_every_call_promptly(ray_without_group_cleanup, tiny_model_dir):
    """SIGKILL only the engine core while a generate runs and a sleep waits on it (it waits for
    in-flight requests): both fail with EngineDeadError instead of hanging, so does every later
    call, health() answers with the cause, and the workers die with their engine core."""
    from rlactors.rollout.engine import create_engine
    from rlactors.rollout.engine_core import EngineDeadError

    engine = create_engine(str(tiny_model_dir), RolloutConfig(max_model_len=256))  # partial_rollout off: sleep waits
    children = []
    try:
        health = get_within(engine.ready.remote(), START_TIMEOUT_S, "engine ready")
        children = [p for p in vllm_processes(health["pid"]) if p.name().startswith("VLLM::")]
        assert len(children) >= 2, children  # the engine core and its worker
        long = SamplingConfig(num_samples_per_prompt=2, max_response_tokens=240, ignore_eos=True)
        stream = engine.generate.remote([PromptRequest("p0", [1, 2, 3])], long)
        for _ in range(600):
            if get_within(engine.health.remote(), CALL_TIMEOUT_S, "health")["num_in_flight_samples"]:
                break
            time.sleep(0.05)
        sleeping = engine.sleep.remote()
        engine_core_of(health["pid"]).send_signal(signal.SIGKILL)

        calls = {
            "generate (in flight)": lambda: next(stream),
            "sleep (waiting on the core)": lambda: sleeping,
            "generate": lambda: next(engine.generate.remote([PromptRequest("p1", [1, 2])], long)),
            "load_weights": lambda: engine.load_weights.remote([], 1),
            "wake_up": lambda: engine.wake_up.remote(),
            "abort": lambda: engine.abort.remote(None),
            "ready": lambda: engine.ready.remote(),
        }
        for name, call in calls.items():
            with pytest.raises(ray.exceptions.RayTaskError) as failure:
                get_within(call(), CALL_TIMEOUT_S, name)
            cause = failure.value.cause
            assert isinstance(cause, EngineDeadError) and type(cause).__name__ == "EngineDeadError", (name, cause)
            assert "vLLM's engine core died (exit code -9, SIGKILL)" in str(cause), (name, str(cause))
        health = get_within(engine.health.remote(), CALL_TIMEOUT_S, "health of a dead engine")
        assert not health["healthy"] and "SIGKILL" in health["error"], health
        # The actor lives on, and so does its multiprocessing resource tracker; vLLM's processes do not.
        wait_until_gone(children, CALL_TIMEOUT_S, "vLLM's workers after their engine core died")
    finally:
        ray.kill(engine)
        kill_all(children)  # only if the test failed
