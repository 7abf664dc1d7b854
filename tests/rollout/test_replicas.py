"""The replicas' revival, one answer at a time, without Ray (over Ray: tests/rollout/test_router_calls.py)."""

from __future__ import annotations

from rlactors.rollout import replicas as replicas_module
from rlactors.rollout.replicas import HEALTHY, LOADING, RESTARTING, Replicas


class Method:
    def __init__(self, calls: list, name: str):
        self.calls, self.name = calls, name

    def remote(self, *args):
        self.calls.append(self.name)
        return f"{self.name}-ref-{len(self.calls)}"


class Engine:
    """What Replicas calls on an actor handle: `ready.remote` and `load_state_dict.remote`."""

    def __init__(self):
        self.calls = []
        self.ready, self.load_state_dict = Method(self.calls, "ready"), Method(self.calls, "load_state_dict")


def test_a_revival_answered_by_the_killed_process_asks_the_restarted_one(monkeypatch):
    # ray.kill is asynchronous: the killed incarnation may still answer the ready() sent after it.
    killed = []
    monkeypatch.setattr(replicas_module.ray, "kill", lambda actor, no_restart=True: killed.append(no_restart))
    engine = Engine()
    replicas = Replicas([engine], policy_version=3, start_timeout_s=60.0, call_timeout_s=60.0)
    replicas.note_pids({0: {"healthy": True, "pid": 111}})
    assert replicas.mark_failed(0, "hung", incarnation=0, kill=True) and killed == [False]

    replicas._apply_revival(0, {"healthy": True, "pid": 111})  # the killed process, before its kill landed
    assert replicas.states[0] == RESTARTING and 0 in replicas._retry_at and replicas.num_failures == [1]
    assert killed == [False]  # killed once: asked again, not killed again

    replicas._apply_revival(0, {"healthy": True, "pid": 222})  # the incarnation Ray restarted
    assert replicas.states[0] == LOADING and replicas.pids == [222] and engine.calls[-1] == "load_state_dict"
    replicas._apply_revival(0, None)  # its load of the current version answered
    assert replicas.states[0] == HEALTHY and replicas.loaded_versions == [3] and replicas.num_failures == [1]


def test_without_a_known_pid_a_healthy_answer_revives_as_before(monkeypatch):
    monkeypatch.setattr(replicas_module.ray, "kill", lambda actor, no_restart=True: None)
    replicas = Replicas([Engine()], policy_version=0, start_timeout_s=60.0, call_timeout_s=60.0)
    replicas.mark_failed(0, "died", incarnation=0, kill=True)
    replicas._apply_revival(0, {"healthy": True})  # an engine that does not say its pid
    assert replicas.states[0] == LOADING
