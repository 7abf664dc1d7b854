"""GenerationStream's choice of replica: the least-loaded, by the tokens its unanswered requests
may hold; over stand-in engine actors (no vLLM) that hold long requests until aborted."""

from __future__ import annotations

import asyncio
import time

import ray

from rlactors.config import SamplingConfig
from rlactors.rollout.router import RolloutRouter
from rlactors.rollout.samples import summarize_group
from rlactors.rollout.stream import least_loaded, request_tokens
from rlactors.types import Group, PromptRequest, Sample


def test_each_request_goes_to_the_replica_with_the_fewest_tokens_in_flight_counting_those_given_out():
    assert least_loaded({0: 0, 1: 0}, [10, 10, 10, 10]) == [0, 1, 0, 1]  # equal work: a round robin
    assert least_loaded({0: 500, 1: 0, 2: 30}, [20, 20, 20]) == [1, 1, 2]  # 20, 40 on replica 1; then 2's 30 < 40
    assert least_loaded({3: 7}, [1, 2]) == [3, 3]


def test_a_request_may_hold_its_prompt_and_response_cap_per_sample():
    request = PromptRequest("p0", [1, 2, 3, 4])
    default = SamplingConfig(num_samples_per_prompt=8, max_response_tokens=16)
    assert request_tokens(request, None, default) == 8 * (4 + 16)
    assert request_tokens(request, {"num_samples_per_prompt": 2, "max_response_tokens": 100}, default) == 2 * 104


@ray.remote(num_cpus=0)
class HoldingEngine:
    """Answers a request with max_response_tokens <= 100 at once; holds a longer one until aborted."""

    def __init__(self):
        self.received, self.aborted = [], asyncio.Event()

    async def ready(self, run_settings=None) -> dict:
        return {"healthy": True}

    @ray.method(num_returns="streaming")
    async def generate(self, requests, sampling=None, with_summaries: bool = False):
        for request, setting in zip(requests, sampling, strict=True):
            self.received.append(request.group_id)
            if setting.max_response_tokens > 100:
                await self.aborted.wait()
            group = Group(request, [Sample(request.prompt_id, 0, list(request.prompt_token_ids), [5], [-0.5], [0],
                                           finish_reason="abort" if self.aborted.is_set() else "length")])
            yield group
            yield summarize_group(group)

    async def abort(self, group_ids=None) -> int:
        self.aborted.set()
        return 1

    def received_group_ids(self) -> list[str]:
        return self.received


def test_a_stream_sends_new_groups_past_a_replica_busy_with_a_long_one(ray_session):
    engines = [HoldingEngine.remote(), HoldingEngine.remote()]
    router = RolloutRouter(engines, start_timeout_s=60, call_timeout_s=30, stall_timeout_s=60, health_timeout_s=10)
    router.ready()
    long, short = SamplingConfig(max_response_tokens=400), SamplingConfig(max_response_tokens=20)
    stream = router.stream()
    stream.add([PromptRequest("long", [1, 2, 3])], long)
    stream.add([PromptRequest("s1", [1, 2, 3]), PromptRequest("s2", [1, 2, 3])], short)  # a round robin: one to 0
    done = []
    deadline = time.monotonic() + 60
    while len(done) < 2 and time.monotonic() < deadline:
        done += stream.next_done(timeout_s=1.0)
    assert sorted(summary.group_id for summary, _ in done) == ["s1#0", "s2#0"] and stream.num_in_flight == 1
    stream.add([PromptRequest("s3", [1, 2, 3])], short)
    assert stream.tokens_in_flight() == {0: 8 * (3 + 400), 1: 8 * (3 + 20)}
    start = time.monotonic()
    stream.close()  # aborts the long one: nothing of the stream is left running
    assert time.monotonic() - start < 30 and stream.num_in_flight == 0
    received = [ray.get(engine.received_group_ids.remote(), timeout=30) for engine in engines]
    assert received == [["long#0"], ["s1#0", "s2#0", "s3#0"]]
    for engine in engines:
        ray.kill(engine)
