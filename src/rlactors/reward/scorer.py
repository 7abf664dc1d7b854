"""The reward scorer actor: scores the groups it is given in its own worker subprocess
(`rlactors.reward.pool.RewardPool` spreads groups over several).

Each actor owns one persistent worker subprocess that runs the scoring function
(`rlactors.reward.worker`: how it and the processes a user function starts are stopped).
The actor sends it a batch and waits at most `timeout_s` for each sample's result. Past that it
kills the subprocess's whole process group, so the work really stops (math-verify's SIGALRM
timeout raises ValueError off the main thread, e.g. in a threaded actor, fires only where the
running code checks for signals, and user code can swallow the exception), records the
timeout against that sample, starts a fresh subprocess and goes on with the next sample.

A sample whose function raises, hangs, returns NaN or a wrong type, or kills its process, gets
score 0.0 and `score_error = "prompt_id=... sample_index=...: <exception>"`; the batch goes on.
When every sample of `reward.max_failed_steps` steps in a row failed, `RewardPool.check_step`
stops the run with the first error (`rlactors.reward.failures`).
"""

from __future__ import annotations

import logging
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray

from rlactors.reward.scoring import load_user_function, overlong_penalty
from rlactors.reward.worker import (
    note_worker,
    start_worker,
    stop_previous_worker,
    stop_worker,
    worker_main,
    worker_record,
)
from rlactors.types import Group, Sample

__all__ = ["RewardScorer", "resolve_function_spec", "worker_main"]  # the worker's command line imports worker_main from here

logger = logging.getLogger(__name__)

NUM_ERRORS_LOGGED = 20  # per actor; every error is also kept in Sample.score_error and counted

COUNTERS = (
    "num_groups",
    "num_samples",
    "num_errors",
    "num_environment_errors",
    "num_timeouts",
    "num_worker_restarts",
    "num_rollout_errors",
)

# --------------------------------------------------------------------------------------------
# The actor


def saved_counters(state: dict[str, Any], names: tuple[str, ...], owner: str) -> tuple[dict[str, int], float]:
    """(counts, scoring_s) from a scorer's `state_dict`; a counter it does not know is an error
    naming `owner`, one the state lacks starts from zero."""
    unknown = set(state["counts"]) - set(names)
    if unknown:
        raise KeyError(f"{owner} state has unknown counters {sorted(unknown)}")
    return dict.fromkeys(names, 0) | {k: int(v) for k, v in state["counts"].items()}, float(state["scoring_s"])


def scored_samples(group: Group) -> list[Sample]:
    """The samples to score: the group's, then its greedy baseline (ReMax) if it has one."""
    return group.samples + ([group.baseline] if group.baseline is not None else [])


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
        function_weight: float = 1.0,
        record_parts: bool = False,
        function_data_sources: list[str] | None = None,
    ) -> None:
        if overlong_buffer_tokens is not None and max_response_tokens is None:
            raise ValueError("overlong penalty needs max_response_tokens")
        self.custom_function, self.gsm8k_mode, self.timeout_s = custom_function, gsm8k_mode, timeout_s
        self.max_response_tokens = max_response_tokens
        self.overlong_buffer_tokens, self.overlong_penalty_factor = (
            overlong_buffer_tokens,
            overlong_penalty_factor,
        )
        # With reward models (`rlactors.reward.model_scorer`) the score is this function's weighted part,
        # the raw one kept in score_details["reward_parts"]["function"]; the models add theirs after.
        self.function_weight, self.record_parts = function_weight, record_parts
        # Rows of other data sources are not the function's: part 0, no call, no error.
        self.function_data_sources = None if function_data_sources is None else frozenset(function_data_sources)
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.scoring_s = 0.0
        self._worker_record = worker_record()
        stop_previous_worker(self._worker_record)  # after a restart: the old worker's group, if left
        self._start_worker()

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
        self.counts, self.scoring_s = saved_counters(state, COUNTERS, "reward scorer")

    def worker_note(self) -> tuple[str, str | None]:
        """(node id, the file on that node where this scorer notes the pid of its current worker,
        which leads its process group): a new worker after a timeout, or after Ray restarted the
        actor, replaces the note, so whoever reads it finds the live one."""
        return ray.get_runtime_context().get_node_id(), self._worker_record

    def close(self) -> None:
        stop_worker(self.process, self.connection)

    def _start_worker(self) -> None:
        self.process, self.connection = start_worker(self.custom_function, self.gsm8k_mode)
        note_worker(self._worker_record, self.process.pid)

    # ----------------------------------------------------------------------------------------

    def _score_groups(self, groups: list[Group]) -> list[Group]:
        start = time.perf_counter()
        tasks, where = [], []
        for group_index, group in enumerate(groups):
            for sample_index, sample in enumerate(scored_samples(group)):
                # An episode's environment scored it already (or failed, see `_finish`).
                request = group.request
                if sample.error is None and sample.environment_error is None and sample.episode_reward is None \
                        and (self.function_data_sources is None or request.data_source in self.function_data_sources):
                    tasks.append((request.data_source, sample.text, request.ground_truth, request.extra_info))
                    where.append((group_index, sample_index))
        results = dict(zip(where, self._run(tasks), strict=True))
        scored = []
        for g, group in enumerate(groups):
            finished = [self._with_part(self._finish(s, results.get((g, i))))
                        for i, s in enumerate(scored_samples(group))]
            baseline = finished.pop() if group.baseline is not None else None
            scored.append(replace(group, samples=finished, baseline=baseline))
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
                stop_worker(self.process, self.connection)
                self._start_worker()
                self.counts["num_worker_restarts"] += 1
                break  # resend the tasks not yet answered to the fresh worker
        return results

    def _finish(self, sample: Sample, result: tuple[float, dict, str | None] | None) -> Sample:
        self.counts["num_samples"] += 1
        where = f"prompt_id={sample.prompt_id} sample_index={sample.sample_index}"
        if sample.error is not None:  # the rollout failed: nothing to score
            self.counts["num_rollout_errors"] += 1
            return replace(
                sample, score=0.0, score_details={}, score_error=f"{where}: not scored: {sample.error}"
            )
        if sample.environment_error is not None:  # its tokens so far train with score 0, the error kept
            self.counts["num_environment_errors"] += 1
            if self.counts["num_environment_errors"] <= NUM_ERRORS_LOGGED:
                logger.warning("environment failed: %s", sample.environment_error)
            return replace(sample, score=0.0, score_details={}, score_error=sample.environment_error)
        if sample.episode_reward is not None:
            result = (sample.episode_reward, {"episode_reward": sample.episode_reward}, None)
        score, details, error = (0.0, {}, None) if result is None else result  # None: not the function's row
        if error is not None:
            self.counts["num_errors"] += 1
            if self.counts["num_errors"] <= NUM_ERRORS_LOGGED:
                logger.warning("reward scoring failed: %s: %s", where, error)
            return replace(sample, score=0.0, score_details={}, score_error=f"{where}: {error}")
        if self.record_parts:
            details = details | {"reward_parts": {"function": score}}
        score = self.function_weight * score
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

    def _with_part(self, sample: Sample) -> Sample:
        """A sample the function did not score, with part 0.0 where `record_parts` asks for parts."""
        if not self.record_parts or "reward_parts" in sample.score_details:
            return sample
        return replace(sample, score_details=sample.score_details | {"reward_parts": {"function": 0.0}})


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
