"""Replay buffer overhead through Ray, with batched calls (one put per batch of groups, one
sample per training batch).

- groups_per_s: a producer actor keeps the buffer full while the driver samples and acks as fast
  as it can (producers and trainer run concurrently, as in a run); the buffer actor's throughput.
- p50_ms / p99_ms: one caller doing reserve -> put -> sample -> ack of one batch, per cycle
  (making the groups is the producer's work and is not timed); groups_per_s_one_caller from the same.
- buffer_share_of_step: the same pipeline with a simulated optimizer step (sleep) between sample
  and ack: the share of the trainer's step spent waiting on buffer calls.

    .venv/bin/python benchmarks/buffer_overhead.py [--batch-size 64] [--num-response-tokens 8]

Prints one final JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import ray

from rlactors.buffer import ReplayBuffer
from rlactors.config import BufferConfig
from rlactors.types import Group, PromptRequest, Sample


def make_group(request: PromptRequest, policy_version: int, num_samples: int, num_response_tokens: int) -> Group:
    """A group shaped like a small real one: n samples of `num_response_tokens` tokens, scored."""
    samples = [
        Sample(request.prompt_id, i, request.prompt_token_ids, list(range(num_response_tokens)),
               [-0.5] * num_response_tokens, [policy_version] * num_response_tokens,
               text="x" * num_response_tokens, score=float(i % 2), score_details={"acc": bool(i % 2)})
        for i in range(num_samples)
    ]
    return Group(request, samples)


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self, buffer, batch_size: int, num_samples: int, num_response_tokens: int):
        self.buffer, self.batch_size = buffer, batch_size
        self.shape = (num_samples, num_response_tokens)
        self.policy_version = 0

    def set_policy_version(self, policy_version: int) -> None:
        self.policy_version = policy_version

    async def run(self) -> int:
        num_groups = 0
        while requests := await self.buffer.reserve.remote(self.batch_size, "producer"):
            await self.buffer.put.remote([make_group(r, self.policy_version, *self.shape) for r in requests])
            num_groups += len(requests)
        return num_groups


def prompts(count: int, start: int) -> list[PromptRequest]:
    return [PromptRequest(f"p{i}", list(range(32))) for i in range(start, start + count)]


def one_caller(args) -> dict:
    """Sequential reserve -> put -> sample -> ack of one batch per cycle: latency per cycle."""
    buffer = ReplayBuffer.remote(BufferConfig(max_staleness=1), batch_size_prompts=args.batch_size)
    total = (args.warmup_cycles + args.cycles) * args.batch_size
    ray.get(buffer.add_prompts.remote(prompts(total, 0)))
    cycle_s = []
    for cycle in range(args.warmup_cycles + args.cycles):
        start = time.perf_counter()
        requests = ray.get(buffer.reserve.remote(args.batch_size, "driver"))
        reserve_s = time.perf_counter() - start
        groups = [make_group(r, 0, args.num_samples, args.num_response_tokens) for r in requests]  # producer's work
        start = time.perf_counter()
        ray.get(buffer.put.remote(groups))
        batch = ray.get(buffer.sample.remote(args.batch_size, 0))
        ray.get(buffer.ack.remote(batch.batch_id))
        assert len(batch) == args.batch_size
        if cycle >= args.warmup_cycles:
            cycle_s.append(reserve_s + time.perf_counter() - start)
    metrics = ray.get(buffer.metrics.remote())
    assert metrics["num_trained"] == total, metrics
    ray.kill(buffer)
    cycle_ms = np.array(cycle_s) * 1e3
    return dict(
        groups_per_s_one_caller=round(args.batch_size * len(cycle_s) / sum(cycle_s), 1),
        p50_ms=round(float(np.percentile(cycle_ms, 50)), 3),
        p99_ms=round(float(np.percentile(cycle_ms, 99)), 3),
        p50_ms_per_group=round(float(np.percentile(cycle_ms, 50)) / args.batch_size, 4),
    )


def pipelined(args, num_steps: int, step_compute_s: float) -> dict:
    """A producer actor keeps the buffer full while the driver trains: sample, a simulated
    optimizer step (sleep), publish the version, ack. Throughput and the buffer's share of a step."""
    config = BufferConfig(max_staleness=1, staleness_threshold=1.0)
    buffer = ReplayBuffer.remote(config, batch_size_prompts=args.batch_size)
    ray.get(buffer.add_prompts.remote(prompts(num_steps * args.batch_size, 0)))
    ray.get(buffer.close.remote())
    producer = Producer.remote(buffer, args.batch_size, args.num_samples, args.num_response_tokens)
    produced = producer.run.remote()
    first = ray.get(buffer.sample.remote(args.batch_size, 0, timeout_s=60))  # the producer has started
    ray.get(buffer.nack.remote(first.batch_id))
    buffer_s, step_s = [], []
    for step in range(num_steps):
        start = time.perf_counter()
        batch = ray.get(buffer.sample.remote(args.batch_size, step))
        sampled = time.perf_counter()
        time.sleep(step_compute_s)  # the optimizer step
        trained = time.perf_counter()
        ray.get(producer.set_policy_version.remote(step + 1))  # weights published to the engine
        ray.get(buffer.ack.remote(batch.batch_id))
        end = time.perf_counter()
        buffer_s.append((sampled - start) + (end - trained))
        step_s.append(end - start)
    ray.get(produced)
    metrics = ray.get(buffer.metrics.remote())
    assert metrics["num_trained"] == num_steps * args.batch_size, metrics
    ray.kill(buffer)
    return dict(
        groups_per_s=round(num_steps * args.batch_size / sum(step_s), 1),
        buffer_share_of_step=round(sum(buffer_s) / sum(step_s), 4),
        buffer_ms_per_step=round(1e3 * float(np.mean(buffer_s)), 3),
        num_evicted_stale=metrics["num_evicted_stale"],
        staleness_max=metrics["staleness_max"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64, help="groups per put / sample call")
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--warmup-cycles", type=int, default=10)
    parser.add_argument("--num-samples", type=int, default=8, help="samples per group")
    parser.add_argument("--num-response-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30, help="simulated training steps in phase 2")
    parser.add_argument("--step-compute-s", type=float, default=0.08, help="simulated optimizer step")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    free_running = pipelined(args, args.cycles, step_compute_s=0.0)
    simulated = pipelined(args, args.steps, args.step_compute_s)
    result = dict(
        batch_size=args.batch_size, num_samples=args.num_samples, num_response_tokens=args.num_response_tokens,
        groups_per_s=free_running["groups_per_s"], **one_caller(args),
        step_compute_s=args.step_compute_s, **{k: v for k, v in simulated.items() if k != "groups_per_s"},
    )
    ray.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
