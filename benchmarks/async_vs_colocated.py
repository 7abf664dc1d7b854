"""Fully-async vs colocated, and where each pool's time goes in async mode: the same GRPO config on
the `small` model, equal numbers of steps (so equal trained samples), one run.

Colocated lets rollout and training take turns on both cores; async gives the rollout engine and
the trainer one core each (`rollout.cpu_cores`, `trainer.cpu_cores`) and overlaps them, with one
batch of look-ahead (two for the long tail), partial rollouts and truncated IS, its producer
streaming groups through the engine (`rlactors.pipelines.fully_async.Producer`).

Two workloads (`--workload`):
- `uniform` (the default): `a+b=` prompts, responses capped at `--max-response-tokens` (16), a toy
  reward an untrained model learns (the share of digits), from the random-init model;
- `long-tail`: the `countdown` task (`rlactors.data.synthetic`), whose answers' lengths are
  log-normal (the p99 about 8x the median, up to a few hundred tokens), from the `small` model after
  a short supervised warm-up (`rlactors.demo.warm_up` with `COUNTDOWN_WARMUP`), scored by its built-in
  partial-credit reward, trained as DAPO runs are: dynamic sampling drops the groups whose answers
  are all right or all wrong (`--dynamic-sampling off` keeps them), and bypass mode spares the
  old-logprob pass. The lengths are the model's own: nothing forces them. Here a colocated step
  waits for its longest response with its engine nearly empty, once per generation round, and
  async streams past it: 32 groups in flight (twice what fills its 128 slots, as a group holds its
  slots until its longest sample ends) and two batches of look-ahead (`staleness_threshold` 2) keep
  its engine busy while the trainer trains, and `max_staleness` 4 lets a long response span the
  syncs it takes.
Either way the final rewards say whether both modes learn alike.

In the async run, per timed step (the first `NUM_WARMUP_STEPS` are not timed), from its metrics:
- the trainer: busy by phase (`timing_s/<phase>`) and its wait for a batch (`timing_s/gen`);
- the rollout pool (`rlactors.pipelines.fully_async.Producer.time_metrics`): the engine generating,
  paused for weight updates, idle, and the producer blocked by the staleness bound or backpressure;
- each core's idle share over the timed steps, from /proc/stat.

`async_efficiency` = (the busier pool's busy seconds per step: the trainer's step minus its wait,
or the engine's generating time) / (async step); `trainer_wait_share` = wait / step;
`rollout_blocked_share` = producer blocked / step; `rollout_efficiency` = generating / (the
engine's time less what the producer was blocked): the rollout side's own bubbles, which bound
`async_efficiency` where the rollout pool is the busier; `speedup` = colocated seconds per trained
sample / async's (the same samples per step: the step ratio). Shares are of the timed steps' means.
`occupancy`: each mode's engine mean running sequences over its generating time / its
max_num_seqs (`rollout/occupancy`), the timed steps' mean; `response_length_percentiles`: the
timed steps' mean p50, p90, p99 and the largest response, per mode; `generated_per_trained`:
groups generated per group trained (above 1 under dynamic sampling).

    .venv/bin/python benchmarks/async_vs_colocated.py [--workload uniform|long-tail] [--num-steps 20]
        [--dynamic-sampling on|off] [--start-model FOLDER]

Prints one JSON line per mode, then one final JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from step_time import IdleWatch  # this folder: the script's own

from rlactors.config import load_config
from rlactors.models import build_tiny_model
from rlactors.pipelines import run_pipeline

HERE = Path(__file__).resolve().parent
NUM_WARMUP_STEPS = 2
TRAINER_PHASES = ("assemble", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "weight_sync")
ROLLOUT_STATES = ("generating", "paused", "idle", "blocked")
BATCH_SIZE_PROMPTS = 16
LONG_TAIL_MAX_RESPONSE_TOKENS = 320  # above the task's longest answer: the lengths are the model's


def workload_overrides(workload: str, max_response_tokens: int, dynamic_sampling: bool) -> list[str]:
    if workload == "uniform":
        return ["data.task=arithmetic", "data.num_train_rows=2000", f"rollout.max_model_len={48 + max_response_tokens}",
                f"rollout.sampling.max_response_tokens={max_response_tokens}",
                f"rollout.validation_sampling.max_response_tokens={max_response_tokens}",
                f"reward.custom_function={HERE / 'digit_reward.py'}:compute_score", "trainer.optim.lr=5e-4"]
    # DAPO's setting, as in the runs peers publish: groups that all answer alike are dropped and more
    # generated (each colocated round pays its tail again), and no old-logprob pass (bypass mode).
    return ["data.task=countdown", "data.num_train_rows=4000",
            f"rollout.max_model_len={32 + LONG_TAIL_MAX_RESPONSE_TOKENS}",
            f"rollout.sampling.max_response_tokens={LONG_TAIL_MAX_RESPONSE_TOKENS}",
            f"rollout.validation_sampling.max_response_tokens={LONG_TAIL_MAX_RESPONSE_TOKENS}", "trainer.optim.lr=3e-5",
            "algorithm.rollout_correction.bypass_mode=true", f"buffer.dynamic_sampling={str(dynamic_sampling).lower()}",
            "buffer.dynamic_sampling_metric=acc"]


def overrides(mode: str, workload: str, model_path: Path, output_dir: Path, num_steps: int,
              max_response_tokens: int, dynamic_sampling: bool = True) -> list[str]:
    common = [
        f"model.path={model_path}", "model.preset=small", "data.num_val_rows=32",
        "rollout.sampling.num_samples_per_prompt=8", f"pipeline.num_steps={num_steps}", f"pipeline.batch_size_prompts={BATCH_SIZE_PROMPTS}",
        "pipeline.val_every_steps=0", f"pipeline.output_dir={output_dir}", "pipeline.resume=never",
        f"pipeline.mode={mode}", *workload_overrides(workload, max_response_tokens, dynamic_sampling),
    ]
    if mode == "async":
        # The long tail: two batches of look-ahead keep the engine streaming while the trainer trains
        # one, a long response may span the four syncs it can take, and twice the groups that fill the
        # engine's 128 slots are in flight (a group holds its slots until its longest sample ends).
        look_ahead = ["buffer.staleness_threshold=1.0", "buffer.max_staleness=1"] if workload == "uniform" else \
            ["buffer.staleness_threshold=2.0", "buffer.max_staleness=4", "pipeline.num_groups_in_flight=32"]
        common += [*look_ahead, "rollout.partial_rollout=true", "algorithm.rollout_correction.importance_level=token",
                   "rollout.cpu_cores=[0]", "trainer.cpu_cores=[1]"]
    return common


def mean_of(history: list[dict], key: str) -> float:
    return statistics.mean(h.get(key, 0.0) for h in history)


def run_mode(mode: str, workload: str, model_path: Path, work: Path, num_steps: int, max_response_tokens: int,
             dynamic_sampling: bool) -> dict:
    output_dir = work / mode
    watch = IdleWatch(output_dir / "metrics.jsonl", 1 + NUM_WARMUP_STEPS, 1 + num_steps)  # line 1: step 0
    config = load_config(None, overrides(mode, workload, model_path, output_dir, num_steps, max_response_tokens,
                                           dynamic_sampling))
    history = [h for h in run_pipeline(config) if h["step"] > 0]
    timed = history[NUM_WARMUP_STEPS:]
    step_s = mean_of(timed, "timing_s/step")
    result = {
        "step_s": step_s,
        "step_s_median": statistics.median(h["timing_s/step"] for h in timed),
        "reward": statistics.mean(h["reward/mean"] for h in history[-5:]),
        "first_reward": history[0]["reward/mean"],
        "staleness_max": max(h["staleness/max"] for h in history),
        "occupancy": statistics.mean(h["rollout/occupancy"] for h in timed if "rollout/occupancy" in h),
        "response_length_percentiles": {
            **{f"p{q}": round(mean_of(timed, f"response_length/p{q}"), 1) for q in (50, 90, 99)},
            "max": max(h["response_length/max"] for h in timed)},
        "evicted_stale": sum(h.get("buffer/num_evicted_stale", 0) for h in history),
        # groups generated per group trained: what dynamic sampling multiplies the generation by
        "generated_per_trained": 1 + mean_of(history, "buffer/num_dropped_zero_variance") / BATCH_SIZE_PROMPTS,
        "core_idle_shares": watch.shares(),
        "trainer_phases_s": {phase: round(mean_of(timed, f"timing_s/{phase}"), 4) for phase in TRAINER_PHASES
                             if mean_of(timed, f"timing_s/{phase}") > 0},
    }
    if mode == "async":
        wait_s = mean_of(timed, "timing_s/gen")
        rollout = {state: mean_of(timed, f"timing_s/rollout_{state}") for state in ROLLOUT_STATES}
        result |= {"trainer_busy_s": step_s - wait_s, "trainer_wait_s": wait_s,
                   "rollout_s": {state: round(seconds, 4) for state, seconds in rollout.items()}}
    return result


def rollout_efficiency(rollout_s: dict[str, float]) -> float:
    """The engine's generating share of the time the staleness bound did not block it: what
    `async_efficiency` would be were the rollout pool the busier one (its own bubbles: paused for
    weight syncs, idle between producer rounds)."""
    unblocked_s = rollout_s["generating"] + rollout_s["paused"] + max(rollout_s["idle"] - rollout_s["blocked"], 0.0)
    return rollout_s["generating"] / max(unblocked_s, 1e-9)


def starting_model(workload: str, work: Path, start_model: Path | None) -> Path:
    """The random-init `small` model, warmed up on the task first for the long tail (its lengths
    must be the model's own answers), or `start_model` (a folder this script warmed up before)."""
    from rlactors.pipelines.build import init_ray

    init_ray(work / "logs")
    if start_model is not None:
        return start_model
    model_path = build_tiny_model(work / "model", "small", seed=0)
    if workload == "uniform":
        return model_path
    from rlactors.demo import COUNTDOWN_WARMUP, warm_up

    config = load_config(None, overrides("colocated", workload, model_path, work / "warm_up", 1, 0))
    model_path = warm_up(config, model_path, work / "warm_model", settings=COUNTDOWN_WARMUP)
    print(f"warmed-up model: {model_path} (--start-model reuses it)", flush=True)
    return model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workload", choices=("uniform", "long-tail"), default="uniform")
    parser.add_argument("--num-steps", type=int, default=20)
    parser.add_argument("--max-response-tokens", type=int, default=16,
                        help="uniform: the responses' length cap (the trainer is the busier pool here at 16 and at 64)")
    parser.add_argument("--dynamic-sampling", choices=("on", "off"), default="on",
                        help="long-tail: DAPO's dynamic sampling (drop the groups that all answer alike) in both modes")
    parser.add_argument("--start-model", type=Path, default=None,
                        help="a model folder to start from instead of building (and warming up) one")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="async_vs_colocated_"))
    dynamic_sampling = args.workload == "long-tail" and args.dynamic_sampling == "on"
    model_path = starting_model(args.workload, work, args.start_model)
    results = {}
    for mode in ("colocated", "async"):
        results[mode] = run_mode(mode, args.workload, model_path, work, args.num_steps, args.max_response_tokens,
                                 dynamic_sampling)
        print(mode, json.dumps(results[mode]), flush=True)
    colocated, fully_async = results["colocated"], results["async"]
    step_s, generating_s = fully_async["step_s"], fully_async["rollout_s"]["generating"]
    busier = "trainer" if fully_async["trainer_busy_s"] >= generating_s else "rollout"
    print(json.dumps({
        "workload": args.workload,
        "dynamic_sampling": dynamic_sampling,
        "num_steps": args.num_steps,
        "max_response_tokens": args.max_response_tokens if args.workload == "uniform" else LONG_TAIL_MAX_RESPONSE_TOKENS,
        "colocated_step_s": round(colocated["step_s"], 4),
        "async_step_s": round(step_s, 4),
        "speedup": round(colocated["step_s"] / step_s, 3),
        "occupancy": {mode: round(results[mode]["occupancy"], 3) for mode in results},
        "response_length_percentiles": {mode: results[mode]["response_length_percentiles"] for mode in results},
        "async_efficiency": round(max(fully_async["trainer_busy_s"], generating_s) / step_s, 3),
        "busier_pool": busier,
        "trainer_wait_share": round(fully_async["trainer_wait_s"] / step_s, 3),
        "rollout_efficiency": round(rollout_efficiency(fully_async["rollout_s"]), 3),
        "rollout_blocked_share": round(fully_async["rollout_s"]["blocked"] / step_s, 3),
        "trainer_busy_s": round(fully_async["trainer_busy_s"], 4),
        "rollout_s": fully_async["rollout_s"],
        "trainer_phases_s": fully_async["trainer_phases_s"],
        "async_core_idle_shares": fully_async["core_idle_shares"],
        "colocated_reward": round(colocated["reward"], 4),
        "async_reward": round(fully_async["reward"], 4),
        "colocated_first_reward": round(colocated["first_reward"], 4),
        "async_first_reward": round(fully_async["first_reward"], 4),
        "async_staleness_max": fully_async["staleness_max"],
        "async_evicted_stale": fully_async["evicted_stale"],
        "generated_per_trained": {mode: round(results[mode]["generated_per_trained"], 3) for mode in results},
    }))


if __name__ == "__main__":
    main()
