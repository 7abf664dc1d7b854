"""Colocated driver: rollout and training take turns on the same devices; strictly on-policy.

Each step: generate a batch with the current weights (engines awake), put the engines to sleep,
compute old/reference logprobs and advantages, update, publish the new weights, wake the engines.

With `trainer.offload` the trainers take turns too (veRL's time-sharing of every device): they hold
their state in host memory while the engines generate, so a step is generate -> engines sleep ->
trainers onload -> logprobs/values, update -> export into the sleeping engines (weights woken,
loaded) -> trainers offload -> engines wake the KV cache. Every actor logs these phases; the run
writes them all to `phase_logs.json` at the end (`rlactors.runtime.phases`). Reward models on the
pool's devices (`reward.models`, not `own_devices`) sleep with the engines and wake before them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rlactors.config import Config
from rlactors.pipelines.build import Run, build_run
from rlactors.pipelines.common import (
    begin,
    end_step,
    feed_prompts,
    finish,
    prepare_batch,
    produce,
    rollout_occupancy,
    sync_weights,
    timed,
    update,
)
from rlactors.pipelines.warm import WarmActors
from rlactors.trainer.group import TrainerGroup


def fill_batch(run: Run, batch_size: int):
    """Generate until the buffer can hand out a full batch. Under dynamic sampling, groups whose
    rewards have zero variance are rejected, so this may take several rounds (bounded by the buffer).
    The buffer is asked without a wait: nothing generates while this driver asks, so what it
    lacks now it lacks until the next `produce`."""
    while (sampled := run.buffer.sample(batch_size, run.policy_version, timeout_s=0.0)) is None:
        pending = run.buffer.num_pending()
        if pending < batch_size:
            feed_prompts(run, batch_size - pending)
        produce(run, batch_size)
    return sampled


def trainers(run: Run) -> list[TrainerGroup]:
    return [group for group in (run.actor, run.reference, run.critic) if group is not None]


def onload_trainers(run: Run) -> dict[str, float]:
    """Trainer state back onto the devices the sleeping engines freed."""
    start = time.perf_counter()
    for group in trainers(run):
        group.onload()
    return {"timing_s/onload": time.perf_counter() - start}


def offload_trainers(run: Run) -> dict[str, float]:
    """Trainer state to host memory, once the engines hold the new weights; rank 0's figures."""
    start = time.perf_counter()
    rank0 = [group.offload()[0] for group in trainers(run)]
    metrics = {"timing_s/offload": time.perf_counter() - start,
               "memory/trainer_offloaded_bytes": float(sum(entry["moved_bytes"] for entry in rank0))}
    if "device_free_bytes" in rank0[-1]["memory"]:  # CUDA/ROCm: what the waking KV cache finds free
        metrics["memory/device_free_after_offload_bytes"] = float(rank0[-1]["memory"]["device_free_bytes"])
    return metrics


def save_phase_logs(run: Run) -> Path:
    """Every engine replica's and trainer rank's phase log, by role, as one JSON file."""
    logs = {"engines": run.router.phase_logs(), **{group.role: group.phase_logs() for group in trainers(run)}}
    path = run.output_dir / "phase_logs.json"
    path.write_text(json.dumps(logs))
    return path


def run_colocated(config: Config, model_path: str | None = None,
                  warm: WarmActors | None = None) -> list[dict]:
    """Train `config.pipeline.num_steps` steps; returns the per-step metrics (also in metrics.jsonl)."""
    run = build_run(config, model_path, warm)  # with trainer.offload the trainers start offloaded
    offload = config.trainer.offload
    history = []
    try:
        logger = begin(run, history)
        while run.step < config.pipeline.num_steps:
            start, clocks = time.perf_counter(), run.router.clocks()
            sampled = fill_batch(run, config.pipeline.batch_size_prompts)
            generated = time.perf_counter()
            timings: dict[str, float] = rollout_occupancy(clocks, run.router.clocks())
            with timed(timings, "sleep"):
                run.router.sleep()  # frees KV cache and weights on GPU; only a state change on CPU
                run.reward.offload()  # reward models on these devices too (every group is scored by now)
            onloaded = onload_trainers(run) if offload else {}
            batch, metrics = prepare_batch(run, sampled)
            metrics |= timings | onloaded | update(run, batch)
            run.buffer.ack(sampled.batch_id)
            updated = time.perf_counter()
            metrics |= sync_weights(run)  # wakes the sleeping engines' weights and loads the new ones
            if offload:
                metrics |= offload_trainers(run)  # the device is the engines' again
            with timed(metrics, "wake_up"):
                run.reward.onload()
                run.router.wake_up()  # the KV cache; generation resumes
            timings = {"step": time.perf_counter() - start, "gen": generated - start, "update": updated - generated}
            history.append(end_step(run, logger, sampled, metrics, timings))
        save_phase_logs(run)
        finish(run, logger)
    finally:
        run.shutdown()
    return history
