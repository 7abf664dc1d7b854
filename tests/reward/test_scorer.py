"""The scorer actors and pool on a real local Ray: scores, refs in and out, failures, timeouts."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray

from rlactors.config import OverlongConfig, RewardConfig
from rlactors.reward import pool as pool_module
from rlactors.reward.failures import ScoringFailedError
from rlactors.reward.pool import RewardPool
from rlactors.reward.scorer import RewardScorer
from rlactors.reward.worker import start_worker, stop_worker
from rlactors.types import Group, PromptRequest, Sample

USER_FUNCTIONS = textwrap.dedent(
    """
    import os, subprocess, sys, time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "raise":
            return 1 / 0
        if solution_str == "hang":
            # Leave a grandchild behind too: the timeout must stop the whole process group.
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            with open(os.path.join(extra_info["pid_dir"], "hang.pids"), "w") as handle:
                handle.write(f"{os.getpid()} {child.pid}")
            while True:  # busy in Python, never returns
                pass
        if solution_str == "nan":
            return float("nan")
        if solution_str == "text":
            return "1.0"
        if solution_str == "exit":
            os._exit(3)
        if solution_str == "slow":
            time.sleep(0.5)
        if solution_str == "mutate":  # 1.0 only if no other sample's call changed this dict
            extra_info.setdefault("seen", []).append(1)
            return float(len(extra_info["seen"]))
        if solution_str == "spawn":  # a grandchild that outlives the call
            child = subprocess.Popen(["sleep", "600"])
            with open(os.path.join(extra_info["pid_dir"], f"spawn.{child.pid}"), "w") as handle:
                handle.write(str(os.getpid()))
            return 1.0
        return {"score": float(solution_str == ground_truth), "acc": solution_str == ground_truth,
                "pid": os.getpid()}
    """
)


def make_group(prompt_id: str, data_source: str, ground_truth: str, texts: list[str], **extra) -> Group:
    request = PromptRequest(
        prompt_id, [1, 2, 3], data_source=data_source, ground_truth=ground_truth, extra_info=dict(extra)
    )
    samples = [
        Sample(prompt_id, i, [1, 2, 3], response_token_ids=list(range(len(text) + 1)), text=text)
        for i, text in enumerate(texts)
    ]
    return Group(request, samples)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a killed process waiting to be reaped is dead


@pytest.fixture(scope="module")
def pool(ray_session):
    # max 8 tokens, the last 4 penalized; test texts have len(text) + 1 tokens. The time limit is
    # generous: a scorer's first MATH call imports its parser, which on a loaded machine can pass the
    # default 5 s and turn a scoring check into a timeout (timeouts: user_pool, 1 s, below).
    config = RewardConfig(
        num_workers=2, timeout_s=60.0, overlong=OverlongConfig(enable=True, buffer_tokens=4, penalty_factor=1.0)
    )
    pool = RewardPool(config, max_response_tokens=8)
    yield pool
    pool.shutdown()


@pytest.fixture(scope="module")
def user_pool(ray_session, tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "user_rewards.py"
    path.write_text(USER_FUNCTIONS)
    pool = RewardPool(RewardConfig(num_workers=2, timeout_s=1.0, custom_function=f"{path}:compute_score"))
    yield pool
    pool.shutdown()


def test_pool_scores_by_data_source_with_overlong_penalty(pool):
    arithmetic = make_group("a0", "synthetic/arithmetic", "82", ["82", "81", "82 and on"])
    math_group = make_group(
        "m0", "HuggingFaceH4/MATH-500", r"\frac{3}{4}", [r"\boxed{0.75}", r"\boxed{\frac{4}{3}}"]
    )
    gsm8k = make_group("g0", "openai/gsm8k", "1000", ["#### 1,000", "1000"])
    scored = ray.get(pool.score_many([arithmetic, math_group, gsm8k]))

    assert [g.prompt_id for g in scored] == ["a0", "m0", "g0"]
    a, m, g = scored
    # "82 and on" has 10 tokens > 8: penalty -(10 - 4) / 4 = -1.5 on top of a correct answer
    assert a.scores == pytest.approx([1.0, 0.0, 1.0 - 1.5])
    assert a.samples[2].score_details == {"acc": True, "pred": 82, "overlong_penalty": pytest.approx(-1.5)}
    # 13 tokens: \boxed{0.75} is right but long
    assert m.samples[0].score_details["acc"] is True
    assert m.scores == pytest.approx([1.0 - 2.25, 0.0 - 4.0])
    assert g.scores == pytest.approx([1.0 - 1.75, 0.0 - 0.25])  # strict mode needs ####
    assert all(s.score_error is None for group in scored for s in group.samples)
    assert arithmetic.samples[0].score is None  # the caller's objects are not touched


def test_refs_in_refs_out(pool):
    @ray.remote
    def generate(prompt_id: str):  # stands in for a rollout engine; self-contained for the worker
        from rlactors.types import Group, PromptRequest, Sample

        request = PromptRequest(prompt_id, [1], data_source="synthetic/arithmetic", ground_truth="5")
        return Group(
            request, [Sample(prompt_id, i, [1], [7], text=text) for i, text in enumerate(["5", "6"])]
        )

    refs = [generate.remote(f"p{i}") for i in range(5)]
    single = pool.score(refs[0])
    many = pool.score_many(refs[1:])
    assert isinstance(single, ray.ObjectRef) and all(isinstance(r, ray.ObjectRef) for r in many)
    scored = ray.get([single, *many])
    assert [g.prompt_id for g in scored] == ["p0", "p1", "p2", "p3", "p4"]
    assert all(g.scores == [1.0, 0.0] for g in scored)


def test_rollout_errors_are_not_scored(pool):
    group = make_group("e0", "synthetic/arithmetic", "5", ["5", "5"])
    group.samples[1].error = "prompt_id=e0: engine died"
    scored = ray.get(pool.score(group))
    assert scored.scores == [1.0, 0.0]
    assert (
        scored.samples[1].score_error == "prompt_id=e0 sample_index=1: not scored: prompt_id=e0: engine died"
    )


def test_unknown_data_source_is_an_error_per_sample(pool):
    before = pool.metrics()
    scored = ray.get(pool.score(make_group("u0", "my/dataset", "5", ["5"])))
    assert scored.scores == [0.0]
    assert (
        "prompt_id=u0 sample_index=0: ValueError: no scorer for data_source 'my/dataset'"
        in scored.samples[0].score_error
    )
    assert pool.metrics()["reward/num_errors"] == before["reward/num_errors"] + 1


@pytest.mark.timeout(90)
def test_failing_and_hanging_functions_affect_only_their_sample(user_pool, tmp_path):
    texts = ["ok", "raise", "hang", "ok", "nan", "text", "exit", "ok"]
    group = make_group("p7", "anything", "ok", texts, pid_dir=str(tmp_path))
    before = user_pool.metrics()
    scored = ray.get(user_pool.score(group))

    assert scored.scores == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    errors = [s.score_error for s in scored.samples]
    assert errors[0] is None and errors[3] is None and errors[7] is None
    expected = {
        1: "ZeroDivisionError",
        2: "TimeoutError",
        4: "ValueError: score is nan",
        5: "TypeError",
        6: "worker process died (exit code 3)",
    }
    for index, name in expected.items():
        assert errors[index].startswith(f"prompt_id=p7 sample_index={index}: ")
        assert name in errors[index]
    # The hung function and the process it started were really stopped.
    worker_pid, child_pid = map(int, (tmp_path / "hang.pids").read_text().split())
    assert not alive(worker_pid) and not alive(child_pid)
    # The samples after the hang ran in a fresh worker.
    assert scored.samples[3].score_details["pid"] != worker_pid

    after = user_pool.metrics()
    delta = {key: after[key] - before[key] for key in after}
    assert delta["reward/num_samples"] == 8
    assert delta["reward/num_errors"] == 5
    assert delta["reward/num_timeouts"] == 1
    assert delta["reward/num_worker_restarts"] == 2  # after the hang and after the exit
    # and the pool keeps going
    assert ray.get(user_pool.score(make_group("p8", "anything", "ok", ["ok"]))).scores == [1.0]


def test_least_loaded_dispatch(user_pool):
    slow = user_pool.score(make_group("s0", "x", "slow", ["slow"]))
    fast = user_pool.score(make_group("s1", "x", "ok", ["ok"]))  # the first actor is busy with `slow`
    slow_group, fast_group = ray.get([slow, fast])
    assert slow_group.samples[0].score_details["pid"] != fast_group.samples[0].score_details["pid"]

    # A batch is cut into one call per actor, each going to an idle actor.
    groups = [make_group(f"b{i}", "x", "slow", ["slow"]) for i in range(4)]
    scored = ray.get(user_pool.score_many(groups))
    assert [g.prompt_id for g in scored] == ["b0", "b1", "b2", "b3"]
    assert len({g.samples[0].score_details["pid"] for g in scored}) == 2


def test_dispatch_from_several_threads_counts_each_call_until_it_finishes(monkeypatch):
    # Async mode dispatches from two threads; here eight, switching as often as Python allows. A call
    # finishes once 40 newer ones were made, so each dispatch's pruning rebuilds the lists of calls.
    numbers, made, finished = itertools.count(), [], set()

    def start_call(group):
        ref = next(numbers)
        made.append(ref)
        return ref

    def wait(refs, **kwargs):
        done = [ref for ref in refs if ref < len(made) - 40]
        finished.update(done)
        return done, [ref for ref in refs if ref >= len(made) - 40]

    monkeypatch.setattr(pool_module.ray, "wait", wait)
    actors = [SimpleNamespace(score=SimpleNamespace(remote=start_call)) for _ in range(4)]
    in_flight, lock = [[] for _ in actors], threading.Lock()

    def dispatch():
        for _ in range(300):
            pool_module._call_least_loaded(actors, in_flight, ["group"], lock)

    threads = [threading.Thread(target=dispatch) for _ in range(8)]
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch_interval)
    kept = [ref for calls in in_flight for ref, _ in calls]
    assert len(made) == 2400 and len(kept) == len(set(kept))  # no call counted twice
    assert set(made) - finished - set(kept) == set()  # nor dropped before it finished


def test_state_dict_round_trip(pool, ray_session):
    ray.get(pool.score(make_group("c0", "synthetic/arithmetic", "5", ["5", "x"])))
    state = pool.state_dict()
    assert state["counts"]["num_samples"] >= 2 and state["models"] == {}  # no reward models in this pool

    fresh = RewardScorer.remote()
    ray.get(fresh.load_state_dict.remote(state))
    assert ray.get(fresh.state_dict.remote()) == {"counts": state["counts"], "scoring_s": state["scoring_s"]}
    assert ray.get(fresh.metrics.remote())["reward/num_samples"] == state["counts"]["num_samples"]
    with pytest.raises(ray.exceptions.RayTaskError, match="unknown counters"):
        ray.get(fresh.load_state_dict.remote({"counts": {"num_bananas": 1}, "scoring_s": 0.0}))
    ray.get(fresh.close.remote())
    ray.kill(fresh)

    pool.load_state_dict(state)  # the totals survive even when the actor count differs
    assert pool.state_dict() == state


def test_bad_configuration_fails_before_scoring(ray_session, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.py"):
        RewardPool(RewardConfig(custom_function=f"{tmp_path}/missing.py:compute_score"))
    with pytest.raises(ValueError, match="reward.overlong.buffer_tokens"):
        RewardPool(
            RewardConfig(overlong=OverlongConfig(enable=True, buffer_tokens=16)), max_response_tokens=8
        )


def test_each_sample_gets_its_own_extra_info(user_pool):
    group = make_group("i0", "x", "ok", ["mutate"] * 4)
    scored = ray.get(user_pool.score(group))
    assert scored.scores == [1.0] * 4  # each call saw a fresh copy of the request's dict
    assert "seen" not in scored.request.extra_info


def test_step_where_every_sample_failed_stops_after_max_failed_steps(user_pool):
    user_pool.failures.num_failed_steps = 0
    failed = ray.get(user_pool.score(make_group("f0", "x", "ok", ["raise", "raise"]))).samples[0].score_error
    fine = ray.get(user_pool.score(make_group("f1", "x", "ok", ["raise", "ok"]))).samples[0].score_error
    user_pool.check_step(2, 2, failed)
    user_pool.check_step(2, 1, fine)  # one scored sample: the streak starts again
    user_pool.check_step(2, 2, failed)
    user_pool.check_step(2, 2, failed)
    with pytest.raises(ScoringFailedError, match=r"3 steps in a row .* first error: prompt_id=f0 sample_index=0: "
                                                 r"ZeroDivisionError"):
        user_pool.check_step(2, 2, failed)


def wait_until_gone(pids: list[int], timeout_s: float = 20.0) -> list[str]:
    """What is still alive after `timeout_s` (a hang guard; normally they go within a second): each
    survivor as pid, state, parent, process group and command line, to tell which one is left."""
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = []
    for pid in (pid for pid in pids if alive(pid)):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        survivors.append(f"pid {pid} state {fields[0]} ppid {fields[1]} pgid {fields[2]}: {command}")
    return survivors


@pytest.mark.timeout(300)
def test_grandchildren_die_with_a_killed_scorer_and_with_the_pool(ray_session, tmp_path, monkeypatch):
    path = tmp_path / "user_rewards.py"
    path.write_text(USER_FUNCTIONS)
    pool = RewardPool(RewardConfig(num_workers=1, custom_function=f"{path}:compute_score"))
    try:
        def spawn() -> tuple[int, int]:
            before = set(tmp_path.glob("spawn.*"))
            assert ray.get(pool.score(make_group("g0", "x", "ok", ["spawn"], pid_dir=str(tmp_path)))).scores == [1.0]
            (record,) = set(tmp_path.glob("spawn.*")) - before
            worker = int(record.read_text())
            assert pool.worker_pids() == [worker]  # the pool knows each incarnation's worker, not the first one's
            return worker, int(record.suffix[1:])  # worker, grandchild

        worker, grandchild = spawn()
        assert alive(grandchild)
        actor_pid = int(Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the ppid
        os.kill(actor_pid, signal.SIGKILL)  # Ray restarts the scorer; its old worker must take its group along
        assert wait_until_gone([worker, grandchild]) == []

        worker, grandchild = spawn()  # the restarted scorer
        # A worker killed from outside cannot kill its group: the actor's next incarnation does.
        actor_pid = int(Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1])
        os.kill(worker, signal.SIGKILL)
        os.kill(actor_pid, signal.SIGKILL)
        assert wait_until_gone([worker, grandchild]) == []

        worker, grandchild = spawn()  # the scorer's third incarnation
        monkeypatch.setattr(pool_module, "CLOSE_TIMEOUT_S", 0.0)  # it does not close in time: its group is killed by hand
        with pytest.raises(RuntimeError, match="scorer 0 did not close within 0 s"):
            pool.shutdown()
        assert wait_until_gone([worker, grandchild]) == []
    finally:
        if pool.actors:
            pool.shutdown()


@contextlib.contextmanager
def worker_with_a_grandchild(tmp_path):
    """A reward worker (no Ray) whose user function has started a grandchild: (process, connection,
    grandchild pid); the worker's group is stopped afterwards."""
    path = tmp_path / "user_rewards.py"
    path.write_text(USER_FUNCTIONS)
    process, connection = start_worker(f"{path}:compute_score", "strict")
    try:
        connection.send([("x", "spawn", "ok", {"pid_dir": str(tmp_path)})])
        assert connection.recv() == (1.0, {}, None)
        (record,) = tmp_path.glob("spawn.*")
        yield process, connection, int(record.suffix[1:])
    finally:
        stop_worker(process, connection)


def test_a_worker_whose_pipe_closes_takes_its_group_along(tmp_path):
    # The race a pool's shutdown can lose: the actor closes the pipe, then is killed before it can
    # kill the worker's group. The worker alone must then end the group.
    with worker_with_a_grandchild(tmp_path) as (process, connection, grandchild):
        assert alive(grandchild)
        connection.close()
        assert wait_until_gone([process.pid, grandchild], timeout_s=30.0) == []


def test_a_worker_killed_alone_still_names_its_group_for_the_pool(tmp_path):
    # Ray SIGKILLs a killed actor's children, the worker among them, before the pool looks: the
    # pool must still kill the group the user function's children are left in, and only that one.
    with worker_with_a_grandchild(tmp_path) as (process, connection, grandchild):
        assert pool_module._is_worker_group(process.pid)  # alive: a reward worker
        os.kill(process.pid, signal.SIGKILL)
        assert pool_module._is_worker_group(process.pid)  # a zombie, then gone: its group is left
        process.wait()
        assert alive(grandchild) and pool_module._is_worker_group(process.pid)
        assert not pool_module._is_worker_group(os.getpid())  # a live process that is not a reward worker
    assert wait_until_gone([grandchild], timeout_s=30.0) == []


def test_a_pool_that_fails_to_start_leaves_no_scorer_behind(ray_session, monkeypatch):
    from ray._private.state import actors

    from rlactors.reward import pool

    def alive_scorers() -> set[str]:
        return {a["ActorID"] for a in actors().values()
                if a["ActorClassName"].endswith("RewardScorer") and a["State"] != "DEAD"}

    before = alive_scorers()
    monkeypatch.setattr(pool, "STARTUP_TIMEOUT_S", 0.01)  # the scorers are still starting when it runs out
    # The error is kept, as a notebook keeps its last traceback: its frames hold the half-built pool,
    # so Ray's reference counting cannot be what stops the scorers.
    with pytest.raises(TimeoutError, match="reward scorer startup") as failure:
        RewardPool(RewardConfig(num_workers=2))
    deadline = time.monotonic() + 30
    while alive_scorers() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive_scorers() - before, failure.value
