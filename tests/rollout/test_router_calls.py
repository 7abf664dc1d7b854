"""The router's calls on every replica (sleep, wake-up, state loads) over stand-in engine actors
(no vLLM): a replica that hangs in one is killed and restarted with the current weights, and the
call goes on with the others instead of stopping the run."""

from __future__ import annotations

import time
from pathlib import Path

import ray

from rlactors.rollout.router import RolloutRouter


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
