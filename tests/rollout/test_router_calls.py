"""The router over stand-in engine actors (no vLLM): a replica that hangs in a call on every replica
(sleep, wake-up, state loads), or whose engine core stops making progress while the actor still
answers health(), is killed and restarted with the current weights, and the run goes on."""

from __future__ import annotations

import os
import time
from pathlib import Path

import ray

from rlactors.rollout import faults
from rlactors.rollout.router import RolloutRouter
from rlactors.rollout.samples import summarize_group
from rlactors.types import Group, PromptRequest, Sample


@ray.remote(num_cpus=0, max_restarts=1)
class StandInEngine:
    """Answers the calls the router makes; `sleep` hangs while the file `hang_marker` exists (its
    first incarnation's), as a replica stuck inside vLLM would."""

    def __init__(self, hang_marker: str):
        self.hang_marker, self.calls = Path(hang_marker), []

    def ready(self, run_settings=None) -> dict:
        self.calls.append("ready")
        return {"healthy": True}

    def sleep(self) -> None:
        self.calls.append("sleep")
        if self.hang_marker.exists():
            self.hang_marker.unlink()  # the next incarnation does not hang
            time.sleep(600)

    def load_state_dict(self, state: dict) -> None:
        self.calls.append(f"load_state_dict {state['policy_version']}")

    def calls_made(self) -> list[str]:
        return self.calls


def test_a_replica_hung_in_sleep_is_killed_restarted_and_loaded_and_the_others_sleep(ray_session, tmp_path):
    (tmp_path / "hang").write_text("")
    engines = [StandInEngine.remote(str(tmp_path / "hang")), StandInEngine.remote(str(tmp_path / "never"))]
    router = RolloutRouter(engines, start_timeout_s=120, call_timeout_s=3.0, stall_timeout_s=60, health_timeout_s=10)
    router.ready()
    router.replicas.publish(5)  # the version a revived replica must load
    start = time.monotonic()
    router.sleep()  # replica 0 hangs: killed within the bound, not a TimeoutError that stops the run
    assert time.monotonic() - start < 60
    health = router.wait_until_healthy(timeout_s=120)
    assert [h["state"] for h in health] == ["healthy", "healthy"], health
    assert health[0]["num_failures"] == 1 and health[0]["last_error"].startswith("sleep: hung, no answer within 3 s")
    assert health[1]["num_failures"] == 0
    # The restarted incarnation was asked ready() and given the current version before any work.
    assert ray.get(engines[0].calls_made.remote(), timeout=60) == ["ready", "load_state_dict 5"]
    assert ray.get(engines[1].calls_made.remote(), timeout=60) == ["ready", "sleep"]
    for engine in engines:
        ray.kill(engine)


@ray.remote(num_cpus=0, max_restarts=1)
class StalledCoreEngine:
    """Its first incarnation takes a batch and never finishes it, while health() answers at once
    with an output count that stands still (a vLLM engine core hung, the actor around it fine); the
    incarnation Ray restarts finishes every request."""

    def __init__(self, stall_marker: str):
        self.stalls = Path(stall_marker).exists()
        Path(stall_marker).unlink(missing_ok=True)
        self.in_flight = 0

    async def ready(self, run_settings=None) -> dict:
        return await self.health()

    async def health(self) -> dict:
        return {"healthy": True, "num_engine_outputs": 7, "num_in_flight_samples": self.in_flight, "paused": False,
                "pid": os.getpid()}

    async def load_state_dict(self, state: dict) -> None:
        pass

    @ray.method(num_returns="streaming")
    async def generate(self, requests, sampling=None, with_summaries: bool = False):
        import asyncio

        self.in_flight = len(requests)
        if self.stalls:
            await asyncio.sleep(600)
        for request in requests:
            group = Group(request, [Sample(request.prompt_id, 0, list(request.prompt_token_ids), [5], [-0.5], [0],
                                           finish_reason="length")])
            yield group
            yield summarize_group(group)
        self.in_flight = 0


def test_a_replica_whose_engine_core_stalls_while_it_answers_health_is_restarted(ray_session, tmp_path, monkeypatch):
    (tmp_path / "stall").write_text("")
    engine = StalledCoreEngine.remote(str(tmp_path / "stall"))
    monkeypatch.setattr(faults, "MIN_ENGINE_STALL_S", 1.0)  # the floor is for real engine steps: seconds here
    router = RolloutRouter([engine], start_timeout_s=120, call_timeout_s=30, stall_timeout_s=1.0, health_timeout_s=30)
    router.ready()
    requests = [PromptRequest(f"p{i}", [1, 2, 3]) for i in range(3)]
    start = time.monotonic()
    groups = list(router.generate(requests))
    assert sorted(g.prompt_id for g in groups) == ["p0", "p1", "p2"] and time.monotonic() - start < 120
    health = router.health()[0]
    assert health["state"] == "healthy" and health["num_failures"] == 1, health
    assert health["last_error"].startswith("hung: its engine core made no progress for "), health
    assert "with 3 sample(s) in flight, though the actor answers health()" in health["last_error"], health
    assert router.num_resent == 3
    ray.kill(engine)
