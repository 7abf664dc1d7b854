"""Reward scorer actors, and the pool that spreads groups over them as soon as they arrive.

    pool = RewardPool(config.reward, max_response_tokens=config.rollout.sampling.max_response_tokens)
    scored_ref = pool.score(group_ref)            # ObjectRef[Group]; scoring starts now
    scored_refs = pool.score_many(group_refs)     # several groups per actor call
    pool.metrics()                                # {"reward/num_errors": ..., "reward/num_timeouts": ...}

Refs in, refs out: Ray resolves the group refs given as top-level arguments inside the actor, so
the driver never fetches a group to score it and scoring overlaps with generation. Scored groups
stay in the object store (`rlactors.transport`), whatever their size.

Each actor owns one persistent worker subprocess that runs the scoring function (see `worker_main`).
The actor sends it a batch and waits at most `timeout_s` for each sample's result. Past that it
kills the subprocess's whole process group, so the work really stops (math-verify's SIGALRM
timeout raises ValueError off the main thread, e.g. in a threaded actor, fires only where the
running code checks for signals, and user code can swallow the exception), records the
timeout against that sample, starts a fresh subprocess and goes on with the next sample.

A sample whose function raises, hangs, returns NaN or a wrong type, or kills its process, gets
score 0.0 and `score_error = "prompt_id=... sample_index=...: <exception>"`; the batch goes on.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from functools import partial
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any

import ray

from rlactors.config import RewardConfig
from rlactors.reward.scoring import check_score, default_compute_score, load_user_function, overlong_penalty
from rlactors.transport import results_in_object_store
from rlactors.types import Group, Sample

logger = logging.getLogger(__name__)

WORKER_STARTUP_TIMEOUT_S = 120.0  # importing sympy and the user's module; generous on a busy machine
MAX_ERROR_CHARS = 2000
NUM_ERRORS_LOGGED = 20  # per actor; every error is also kept in Sample.score_error and counted

COUNTERS = (
    "num_groups",
    "num_samples",
    "num_errors",
    "num_timeouts",
    "num_worker_restarts",
    "num_rollout_errors",
)

# --------------------------------------------------------------------------------------------
# The worker subprocess


def _exit_when_orphaned(parent_pid: int) -> None:
    # If the actor dies (ray.kill sends SIGKILL) the worker must not live on running user code.
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def _describe(error: BaseException) -> str:
    try:
        text = f"{type(error).__name__}: {error}"
    except Exception:  # a user exception whose __str__ raises
        text = type(error).__name__
    return text[:MAX_ERROR_CHARS]


def worker_main(fd: int, custom_function: str, gsm8k_mode: str) -> None:
    """Loop of the worker subprocess. Receives lists of (data_source, text, ground_truth,
    extra_info) and sends one (score, details, error) per item, in order, as each finishes."""
    connection = Connection(fd)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    try:
        if custom_function:
            compute_score = load_user_function(custom_function)
        else:
            compute_score = partial(default_compute_score, gsm8k_mode=gsm8k_mode)
    except BaseException as error:
        connection.send(("failed", _describe(error)))
        return
    connection.send(("ready", os.getpid()))
    while True:
        try:
            tasks = connection.recv()
        except EOFError:  # the actor closed the pipe
            return
        for data_source, text, ground_truth, extra_info in tasks:
            try:
                score, details = check_score(compute_score(data_source, text, ground_truth, extra_info))
                connection.send((score, details, None))
            except BaseException as error:  # SystemExit from user code included: only this sample fails
                connection.send((0.0, {}, _describe(error)))


def _start_worker(custom_function: str | None, gsm8k_mode: str) -> tuple[subprocess.Popen, Connection]:
    ours, theirs = Pipe()
    code = "import sys; from rlactors.reward.scorer import worker_main; worker_main(*__import__('json').loads(sys.argv[1]))"
    arguments = json.dumps([theirs.fileno(), custom_function or "", gsm8k_mode])
    # The child sees the modules the actor sees (a user function importable here imports there).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    process = subprocess.Popen(
        [sys.executable, "-c", code, arguments], pass_fds=(theirs.fileno(),), env=env, start_new_session=True
    )
    theirs.close()
    if not ours.poll(WORKER_STARTUP_TIMEOUT_S):
        _stop_worker(process, ours)
        raise RuntimeError(f"reward worker did not start within {WORKER_STARTUP_TIMEOUT_S} s")
    try:
        status, detail = ours.recv()
    except EOFError:
        _stop_worker(process, ours)
        raise RuntimeError(f"reward worker exited at startup (exit code {process.wait()})") from None
    if status != "ready":
        _stop_worker(process, ours)
        raise RuntimeError(f"reward worker failed to start: {detail}")
    return process, ours


def _stop_worker(process: subprocess.Popen, connection: Connection) -> None:
    connection.close()
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the group: children the user function started too
    except ProcessLookupError:
        pass
    process.wait()


# --------------------------------------------------------------------------------------------
# The actor


@ray.remote(max_restarts=2, max_task_retries=2)  # scoring is a pure function of its input: retries are safe
class RewardScorer:
    """Scores groups in its worker subprocess. Checkpoint (`state_dict`): the cumulative counters
    only; the subprocess is rebuilt from the constructor arguments. A restarted actor's counters
    start from zero unless reloaded."""

    def __init__(
        self,
        custom_function: str | None = None,
        gsm8k_mode: str = "strict",
        timeout_s: float = 5.0,
        max_response_tokens: int | None = None,
        overlong_buffer_tokens: int | None = None,
        overlong_penalty_factor: float = 1.0,
    ) -> None:
        if overlong_buffer_tokens is not None and max_response_tokens is None:
            raise ValueError("overlong penalty needs max_response_tokens")
        self.custom_function, self.gsm8k_mode, self.timeout_s = custom_function, gsm8k_mode, timeout_s
        self.max_response_tokens = max_response_tokens
        self.overlong_buffer_tokens, self.overlong_penalty_factor = (
            overlong_buffer_tokens,
            overlong_penalty_factor,
        )
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.scoring_s = 0.0
        self.process, self.connection = _start_worker(custom_function, gsm8k_mode)

    def score(self, group: Group) -> Group:
        return self._score_groups([group])[0]

    def score_groups(self, *groups: Group) -> list[Group]:
        """Call with `.options(num_returns=len(groups))` to get one ref per group."""
        return self._score_groups(list(groups))

    def metrics(self) -> dict[str, float]:
        return {f"reward/{name}": float(value) for name, value in self.counts.items()} | {
            "reward/scoring_s": self.scoring_s
        }

    def state_dict(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "scoring_s": self.scoring_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state["counts"]) - set(COUNTERS)
        if unknown:
            raise KeyError(f"reward scorer state has unknown counters {sorted(unknown)}")
        self.counts = dict.fromkeys(COUNTERS, 0) | {k: int(v) for k, v in state["counts"].items()}
        self.scoring_s = float(state["scoring_s"])

    def close(self) -> None:
        _stop_worker(self.process, self.connection)

    # ----------------------------------------------------------------------------------------

    def _score_groups(self, groups: list[Group]) -> list[Group]:
        start = time.perf_counter()
        tasks, where = [], []
        for group_index, group in enumerate(groups):
            for sample_index, sample in enumerate(group.samples):
                if sample.error is None:
                    request = group.request
                    tasks.append((request.data_source, sample.text, request.ground_truth, request.extra_info))
                    where.append((group_index, sample_index))
        results = dict(zip(where, self._run(tasks), strict=True))
        scored = [
            replace(
                group, samples=[self._finish(s, results.get((g, i))) for i, s in enumerate(group.samples)]
            )
            for g, group in enumerate(groups)
        ]
        self.counts["num_groups"] += len(groups)
        self.scoring_s += time.perf_counter() - start
        return scored

    def _run(self, tasks: list[tuple]) -> list[tuple[float, dict, str | None]]:
        """One (score, details, error) per task, in order. Invariant: the worker answers the
        tasks in the order sent, so a missing answer belongs to the first unanswered task."""
        results: list[tuple[float, dict, str | None]] = []
        while len(results) < len(tasks):
            self.connection.send(tasks[len(results) :])
            while len(results) < len(tasks):
                failure = None
                if not self.connection.poll(self.timeout_s):
                    failure = f"TimeoutError: scoring took over {self.timeout_s} s; worker process killed"
                    self.counts["num_timeouts"] += 1
                else:
                    try:
                        results.append(self.connection.recv())
                        continue
                    except (EOFError, OSError):
                        try:  # the pipe closes as the process exits: give it a moment to be reaped
                            exit_code = self.process.wait(timeout=5.0)
                        except subprocess.TimeoutExpired:
                            exit_code = None
                        failure = f"RuntimeError: worker process died (exit code {exit_code})"
                results.append((0.0, {}, failure))
                _stop_worker(self.process, self.connection)
                self.process, self.connection = _start_worker(self.custom_function, self.gsm8k_mode)
                self.counts["num_worker_restarts"] += 1
                break  # resend the tasks not yet answered to the fresh worker
        return results

    def _finish(self, sample: Sample, result: tuple[float, dict, str | None] | None) -> Sample:
        self.counts["num_samples"] += 1
        where = f"prompt_id={sample.prompt_id} sample_index={sample.sample_index}"
        if result is None:  # the rollout failed: nothing to score
            self.counts["num_rollout_errors"] += 1
            return replace(
                sample, score=0.0, score_details={}, score_error=f"{where}: not scored: {sample.error}"
            )
        score, details, error = result
        if error is not None:
            self.counts["num_errors"] += 1
            if self.counts["num_errors"] <= NUM_ERRORS_LOGGED:
                logger.warning("reward scoring failed: %s: %s", where, error)
            return replace(sample, score=0.0, score_details={}, score_error=f"{where}: {error}")
        if self.overlong_buffer_tokens is not None:
            penalty = overlong_penalty(
                sample.num_response_tokens,
                self.max_response_tokens,
                self.overlong_buffer_tokens,
                self.overlong_penalty_factor,
            )
            details = details | {"overlong_penalty": penalty}
            score += penalty
        return replace(sample, score=score, score_details=details, score_error=None)


# --------------------------------------------------------------------------------------------
# The pool


def resolve_function_spec(spec: str | None) -> str | None:
    """Loads the user function here (a bad spec fails before any actor starts) and makes a file
    path absolute (actors may run in another working directory)."""
    if not spec:
        return None
    load_user_function(spec)
    location, _, name = spec.rpartition(":")
    if location.endswith(".py"):
        return f"{Path(location).expanduser().resolve()}:{name}"
    return spec


class RewardPool:
    """N `RewardScorer` actors; each call goes to the actor with the fewest groups in flight."""

    def __init__(self, config: RewardConfig, max_response_tokens: int | None = None) -> None:
        overlong_buffer_tokens = None
        if config.overlong.enable:
            if max_response_tokens is None or config.overlong.buffer_tokens > max_response_tokens:
                raise ValueError(
                    f"reward.overlong.buffer_tokens ({config.overlong.buffer_tokens}) must be at most "
                    f"max_response_tokens ({max_response_tokens})"
                )
            overlong_buffer_tokens = config.overlong.buffer_tokens
        self.max_groups_per_call = config.max_groups_per_call
        custom_function = resolve_function_spec(config.custom_function)
        self.actors = [
            RewardScorer.options(**results_in_object_store({"num_cpus": config.num_cpus_per_worker})).remote(
                custom_function,
                config.gsm8k_mode,
                config.timeout_s,
                max_response_tokens,
                overlong_buffer_tokens,
                config.overlong.penalty_factor,
            )
            for _ in range(config.num_workers)
        ]
        self.in_flight: list[list[tuple[ray.ObjectRef, int]]] = [[] for _ in self.actors]
        ray.get([actor.metrics.remote() for actor in self.actors])  # surface startup errors here

    def score(self, group: Group | ray.ObjectRef) -> ray.ObjectRef:
        """Ref to the scored copy of `group` (a Group or a ref to one)."""
        index = self._least_loaded()
        ref = self.actors[index].score.remote(group)
        self.in_flight[index].append((ref, 1))
        return ref

    def score_many(self, groups: list[Group | ray.ObjectRef]) -> list[ray.ObjectRef]:
        """Refs to the scored copies, in order; up to `max_groups_per_call` groups per actor call,
        spread over the actors."""
        per_call = max(1, min(self.max_groups_per_call, math.ceil(len(groups) / len(self.actors))))
        refs: list[ray.ObjectRef] = []
        for start in range(0, len(groups), per_call):
            chunk = groups[start : start + per_call]
            if len(chunk) == 1:
                refs.append(self.score(chunk[0]))
                continue
            index = self._least_loaded()
            chunk_refs = self.actors[index].score_groups.options(num_returns=len(chunk)).remote(*chunk)
            self.in_flight[index].append((chunk_refs[0], len(chunk)))
            refs += chunk_refs
        return refs

    def metrics(self) -> dict[str, float]:
        """Cumulative counters summed over the actors (reward/num_errors counts timeouts too)."""
        total: dict[str, float] = {}
        for metrics in ray.get([actor.metrics.remote() for actor in self.actors]):
            for key, value in metrics.items():
                total[key] = total.get(key, 0.0) + value
        return total

    def state_dict(self) -> dict[str, Any]:
        """The counters summed over actors (so a resume may change num_workers)."""
        states = ray.get([actor.state_dict.remote() for actor in self.actors])
        counts = {name: sum(state["counts"][name] for state in states) for name in COUNTERS}
        return {"counts": counts, "scoring_s": sum(state["scoring_s"] for state in states)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The first actor takes the totals, the others start from zero."""
        empty = {"counts": dict.fromkeys(COUNTERS, 0), "scoring_s": 0.0}
        ray.get(
            [actor.load_state_dict.remote(state if i == 0 else empty) for i, actor in enumerate(self.actors)]
        )

    def shutdown(self) -> None:
        ray.get([actor.close.remote() for actor in self.actors])
        for actor in self.actors:
            ray.kill(actor)
        self.actors, self.in_flight = [], []

    def _least_loaded(self) -> int:
        for calls in self.in_flight:
            if calls:
                done, _ = ray.wait(
                    [ref for ref, _ in calls], num_returns=len(calls), timeout=0, fetch_local=False
                )
                done_set = set(done)
                calls[:] = [(ref, n) for ref, n in calls if ref not in done_set]
        loads = [sum(n for _, n in calls) for calls in self.in_flight]
        return loads.index(min(loads))
