"""Colocated driver: rollout and training take turns on the same devices; strictly on-policy.

Each step: generate a batch with the current weights (engines awake), put the engines to sleep,
compute old/reference logprobs and advantages, update, publish the new weights, wake the engines.
"""

from __future__ import annotations

import time

import ray

from rlactors.config import Config
from rlactors.pipelines.common import (
    Run,
    begin,
    build_run,
    end_step,
    feed_prompts,
    finish,
    prepare_batch,
    produce,
    sync_weights,
    update,
)


def fill_batch(run: Run, batch_size: int):
    """Generate until the buffer can hand out a full batch. Under dynamic sampling, groups whose
    rewards have zero variance are rejected, so this may take several rounds (bounded by the buffer)."""
    while True:
        try:
            return ray.get(run.buffer.sample.remote(batch_size, run.policy_version, 0.01))
        except TimeoutError:
            pending = ray.get(run.buffer.metrics.remote())["num_pending"]
            if pending < batch_size:
                feed_prompts(run, batch_size - pending)
            produce(run, batch_size)


def run_colocated(config: Config, model_path: str | None = None) -> list[dict]:
    """Train `config.pipeline.num_steps` steps; returns the per-step metrics (also in metrics.jsonl)."""
    run = build_run(config, model_path)
    history = []
    try:
        logger = begin(run, history)
        while run.step < config.pipeline.num_steps:
            start = time.perf_counter()
            sampled = fill_batch(run, config.pipeline.batch_size_prompts)
            generated = time.perf_counter()
            run.router.sleep()  # frees KV cache and weights on GPU; only a state change on CPU
            batch, metrics = prepare_batch(run, sampled.groups)
            metrics |= update(run, batch)
            ray.get(run.buffer.ack.remote(sampled.batch_id))
            updated = time.perf_counter()
            metrics |= sync_weights(run)  # loads the new weights into the sleeping engines
            run.router.wake_up()
            timings = {"step": time.perf_counter() - start, "gen": generated - start, "update": updated - generated}
            history.append(end_step(run, logger, sampled, metrics, timings))
        finish(run, logger)
    finally:
        run.shutdown()
    return history
