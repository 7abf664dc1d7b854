"""Replicas: the rollout router's book of its engine replicas, shared by the driver's threads.

    replicas = Replicas(engines, start_timeout_s=600, call_timeout_s=900)
    replicas.live()                                # [(replica, incarnation)] healthy now
    replicas.mark_failed(index, reason, incarnation, kill=False)
    replicas.publish(policy_version)               # what revived replicas load; returns live()
    replicas.weight_loader = load                  # how: the trainer sends them its weights
    replicas.poll(timeout_s); replicas.reviving(); replicas.health()

Each replica is `healthy`, `restarting` (its actor failed; asking `ready()` until Ray has restarted
it), `loading` (restarted; loading the current weights before it gets work: `weight_loader`, which
the driver sets to a sync from the trainer, so no copy of the weights is kept for revivals) or `dead` (no restarts
left, a failed restart, or no revival within its bound: `start_timeout_s` for the restart,
`call_timeout_s` for the load; its actor is then ended). Every failure counts once, with its
reason kept as the replica's last error.

Threads: in async mode the producer thread generates while the trainer thread publishes weights
(and validation generates too), so all of them call in here. `_lock` guards every field that
changes after construction. It is held only while reading or changing them, never across
`ray.wait` or a `ray.get` that can block: a wait runs on a snapshot, and its answers are applied
under the lock only if they are still current (an answer another thread already applied is
skipped). A failure reported by a call sent to an older incarnation of a replica (`mark_failed`'s
`incarnation`) is neither counted twice nor allowed to kill the restarted actor. A replica whose
load of version v finishes after the policy moved on is loaded again, so none turns healthy with
old weights.
"""

from __future__ import annotations

import threading
import time

import ray

from rlactors.rollout.faults import LOST_RESULT_ERRORS, is_engine_dead
from rlactors.runtime.calls import error_text, outcome

HEALTHY, DEAD, RESTARTING, LOADING = "healthy", "dead", "restarting", "loading"
RETRY_INTERVAL_S = 1.0  # how often a restarting actor is asked ready() again


class Replicas:
    def __init__(self, engines: list, policy_version: int, start_timeout_s: float, call_timeout_s: float):
        num_engines = len(engines)
        self.engines = list(engines)
        self.start_timeout_s, self.call_timeout_s = start_timeout_s, call_timeout_s
        self.lock = threading.RLock()
        self.states = [HEALTHY] * num_engines
        self.num_failures = [0] * num_engines
        self.last_errors: list[str | None] = [None] * num_engines
        self.policy_version = policy_version
        # Loads the current weights into a revived replica: (index -> (engine, incarnation),
        # policy_version) -> ObjectRef of the sync's figures. None: it gets the version label only.
        self.weight_loader = None
        # A run on engines kept from another (`RolloutRouter.new_run`): its rollout settings, which a
        # replica Ray restarts (constructed with the other run's) gets with ready().
        self.run_settings = None
        # The version each replica is known to hold (its last completed load): every token it
        # generates from now on carries this version or a newer one, unless it restarted unseen.
        self.loaded_versions = [policy_version] * num_engines
        self._incarnations = [0] * num_engines  # +1 at each failure: calls carry the one they were sent to
        self._revivals: dict[int, ray.ObjectRef] = {}  # replica -> pending ready() or weight load
        self._retry_at: dict[int, float] = {}  # restarting replica -> when to ask ready() again
        self._revive_by: dict[int, float] = {}  # reviving replica -> when it is given up as dead
        self._loading_version: dict[int, int] = {}  # replica -> policy_version its pending load carries
        # Each replica's actor process, as its last ready() answer gave it (None: not known).
        self.pids: list[int | None] = [None] * num_engines
        # Reviving replicas whose actor was killed for the current failure -> the killed process's pid.
        self._killed: dict[int, int | None] = {}

    def health(self) -> list[dict]:
        with self.lock:
            return [{"replica": i, "state": self.states[i], "num_failures": self.num_failures[i],
                     "last_error": self.last_errors[i]} for i in range(len(self.engines))]

    def live(self) -> list[tuple[int, int]]:
        """(replica, incarnation) of each healthy replica, revivals polled first."""
        self.poll(timeout_s=0)
        with self.lock:
            return self._healthy()

    def _healthy(self) -> list[tuple[int, int]]:
        return [(i, self._incarnations[i]) for i, state in enumerate(self.states) if state == HEALTHY]

    def publish(self, policy_version: int) -> list[tuple[int, int]]:
        """Record the version revived replicas load and return `live()`, in one step: a replica
        left out (reviving) loads this version (`weight_loader`) before it turns healthy."""
        self.poll(timeout_s=0)
        with self.lock:
            self.policy_version = policy_version
            return self._healthy()

    def confirm_loaded(self, index: int, incarnation: int, policy_version: int) -> None:
        """A load of `policy_version` into the given incarnation of `index` completed."""
        with self.lock:
            if incarnation == self._incarnations[index]:
                self.loaded_versions[index] = policy_version

    def loaded_version(self, index: int) -> int:
        with self.lock:
            return self.loaded_versions[index]

    def mark_failed(self, index: int, reason: str, incarnation: int | None = None, kill: bool = False) -> bool:
        """Count a failure of `index` and start reviving it, unless it is dead or the failure is of
        an incarnation already counted. `kill`: end the actor first (Ray restarts it if allowed).
        Returns whether the failure was counted."""
        with self.lock:
            if self.states[index] == DEAD or (incarnation is not None and incarnation != self._incarnations[index]):
                return False
            self._fail(index, reason, kill)
            return True

    def note_pids(self, answers: dict[int, dict]) -> None:
        """The actor processes ready() answered from (`RolloutEngine.health()["pid"]`): a revival
        whose ready() the killed process answers, before its kill landed, is asked again."""
        with self.lock:
            for index, answer in answers.items():
                self.pids[index] = answer.get("pid") if isinstance(answer, dict) else None

    def mark_dead(self, problems: dict[int, str]) -> None:
        """Replicas that failed to start, with their errors (their actors are the caller's to end)."""
        with self.lock:
            for index, problem in problems.items():
                self.states[index], self.last_errors[index] = DEAD, problem

    def _fail(self, index: int, reason: str, kill: bool) -> None:
        """Count a failure and start the revival (lock held)."""
        self._killed.pop(index, None)
        if kill:
            ray.kill(self.engines[index], no_restart=False)
            self._killed[index] = self.pids[index]
        self.num_failures[index] += 1
        self._incarnations[index] += 1
        self.last_errors[index] = reason
        self.states[index] = RESTARTING
        self._loading_version.pop(index, None)
        self._revive_by[index] = time.monotonic() + self.start_timeout_s
        self._ask_ready(index)

    def _ask_ready(self, index: int) -> None:
        # Answers once Ray has restarted the actor (max_restarts > 0); fails with
        # ActorUnavailableError while it is restarting (asked again a second later) and with
        # ActorDiedError once it has no restarts left (the replica is then dead). Lock held.
        self._retry_at.pop(index, None)
        self._revivals[index] = self.engines[index].ready.remote(self.run_settings)

    def _give_up(self, index: int, reason: str) -> None:
        """The replica is dead for the rest of the run; its actor is ended (lock held)."""
        self.states[index], self.last_errors[index] = DEAD, reason
        for table in (self._revivals, self._retry_at, self._revive_by, self._loading_version):
            table.pop(index, None)
        self._killed.pop(index, None)
        ray.kill(self.engines[index], no_restart=True)

    def reviving(self) -> bool:
        with self.lock:
            return bool(self._revivals or self._retry_at)

    def revival_refs(self) -> list[ray.ObjectRef]:
        with self.lock:
            return list(self._revivals.values())

    def poll(self, timeout_s: float) -> None:
        """Move revivals on, waiting up to `timeout_s` for one of them to answer."""
        with self.lock:
            now = time.monotonic()
            for index, deadline in list(self._revive_by.items()):
                if now > deadline:
                    restarting = self.states[index] == RESTARTING
                    self._give_up(index, f"{'no restart' if restarting else 'no weight load'} within "
                                         f"{self.start_timeout_s if restarting else self.call_timeout_s:g} s "
                                         f"(rollout.{'start' if restarting else 'call'}_timeout_s) after: "
                                         f"{self.last_errors[index]}")
            for index, retry_at in list(self._retry_at.items()):
                if now >= retry_at:
                    self._ask_ready(index)
            waiting, retrying = dict(self._revivals), bool(self._retry_at)
        if not waiting:
            time.sleep(min(timeout_s, 0.5) if retrying else 0)
            return
        refs = list(waiting.values())
        done, _ = ray.wait(refs, num_returns=1, timeout=timeout_s, fetch_local=False)
        if done:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        done = set(done)
        answers = {index: (ref, outcome(ref, self.call_timeout_s)) for index, ref in waiting.items() if ref in done}
        with self.lock:
            for index, (ref, answer) in answers.items():
                if self._revivals.get(index) is ref:  # else another thread applied this answer
                    del self._revivals[index]
                    self._apply_revival(index, answer)

    def _apply_revival(self, index: int, answer) -> None:
        """Move a reviving replica on: ready() answered -> load the current weights -> healthy (lock held)."""
        engine, state = self.engines[index], self.states[index]
        stage = "restart" if state == RESTARTING else "weight load"
        task_error = isinstance(answer, ray.exceptions.RayTaskError)
        killed_answered = (isinstance(answer, dict) and answer.get("pid") is not None
                           and self._killed.get(index) == answer["pid"])
        if state == RESTARTING and (killed_answered or is_engine_dead(answer)
                                    or (isinstance(answer, dict) and answer.get("healthy") is False)):
            # The old incarnation answered before the kill landed (ray.kill is asynchronous): the
            # killed process itself, or a vLLM engine dead in it (or not killed: its failure was of
            # another kind). Not a new failure; ask the incarnation Ray restarts.
            if index not in self._killed:
                ray.kill(engine, no_restart=False)
                self._killed[index] = self.pids[index]
            self._retry_at[index] = time.monotonic() + RETRY_INTERVAL_S
            return
        if isinstance(answer, ray.exceptions.ActorUnavailableError) or (
                isinstance(answer, LOST_RESULT_ERRORS) and not task_error):
            self.states[index] = RESTARTING  # start over from ready()
            self._retry_at[index] = time.monotonic() + RETRY_INTERVAL_S
            return
        if state == LOADING and (is_engine_dead(answer) or isinstance(answer, ray.exceptions.RayActorError)):
            self._fail(index, f"{stage}: {error_text(answer)}", kill=is_engine_dead(answer))  # Ray restarts it if allowed
            return
        if state == LOADING and isinstance(answer, dict) and index not in answer.get("synced", (index,)):
            # Its update may be half done: a fresh incarnation loads again.
            self._fail(index, f"{stage}: {(answer.get('failed') or {}).get(index, 'not synced')}",
                       kill=index not in answer.get("actor_died", ()))
            return
        if isinstance(answer, BaseException):  # no restarts left, or vLLM failed to start again
            self._give_up(index, f"{self.last_errors[index]}; then the {stage} failed: {error_text(answer)}")
            return
        if state == RESTARTING or self._loading_version.get(index) != self.policy_version:
            # A restarted actor holds the initial checkpoint at version 0 (and a load that finished
            # after a newer update holds old weights): bring it up to date before it gets work.
            if state == RESTARTING and isinstance(answer, dict):
                self.pids[index] = answer.get("pid")
            self.states[index] = LOADING
            self._loading_version[index] = self.policy_version
            self._revive_by[index] = time.monotonic() + self.call_timeout_s
            try:
                self._revivals[index] = (
                    self.weight_loader({index: (engine, self._incarnations[index])}, self.policy_version)
                    if self.weight_loader is not None
                    else engine.load_state_dict.remote({"policy_version": self.policy_version})
                )
            except Exception as error:  # the sender cannot be asked (its trainer group is gone)
                self._give_up(index, f"{self.last_errors[index]}; then no weight load could start: {error}")
            return
        self.states[index] = HEALTHY
        self.loaded_versions[index] = self._loading_version.pop(index, self.policy_version)
        self._revive_by.pop(index, None)
        self._killed.pop(index, None)

    def no_live_message(self, prompt_ids: list[str]) -> str:
        prompt_ids = sorted(prompt_ids)
        replicas = [f"  replica {h['replica']}: {h['state']}, {h['num_failures']} failure(s), last error: "
                    f"{h['last_error'] or 'none'}" for h in self.health()]
        return (f"no live rollout engine left and none restarting; {len(prompt_ids)} request(s) unanswered "
                f"(prompt_ids {prompt_ids[:5]}{' ...' if len(prompt_ids) > 5 else ''}). Replicas:\n" + "\n".join(replicas))
