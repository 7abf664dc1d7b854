"""Routing replay on an MoE model in fully-async mode: the same run with replay off and on, one
after the other in one process, same seeds.

The model is the `small` preset as a Qwen3-MoE (8 experts, 2 routed per token, 4 layers); the
task is the toy digit reward (benchmarks/digit_reward.py), which an untrained model learns, so the
policy moves every step. Async with `buffer.max_staleness=2` (and partial rollouts) trains samples
up to two versions older than the trainer: the trainer's old logprobs come from newer weights
than the rollout's, and an MoE router may send a token elsewhere. Both runs record the engine's
routing (`rollout.record_routing`); only the second routes the trainer by it
(`trainer.routing_replay=rollout`). Per run, over the timed steps (the first `NUM_WARMUP_STEPS`
are not timed):
- `routing_mismatch_share`: (token, layer) pairs where the trainer's own top-k differs from the
  engine's (the same quantity in both runs: replay uses the record, it does not change the router);
- `log_ratio_abs_mean` / `log_ratio_abs_max`: |rollout logprob - trainer old logprob| over the
  trained tokens (`rollout/logprob_abs_diff_mean`, `_max`);
- `clip_fraction` (`actor/pg_clipfrac`), `step_s`, `staleness_max`.

Final line: `replay_ratio_error_reduction` = log_ratio_abs_mean off / on (target >= 1.5) and
`step_time_cost` = step_s on / off - 1 (target <= 0.10).

    .venv/bin/python benchmarks/moe_replay.py [--num-steps 12] [--lr 2e-4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from rlactors.config import load_config
from rlactors.models import build_tiny_model
from rlactors.pipelines import run_pipeline

HERE = Path(__file__).resolve().parent
NUM_WARMUP_STEPS = 2


def overrides(model_path: Path, output_dir: Path, num_steps: int, replay: bool, lr: float) -> list[str]:
    return [
        f"model.path={model_path}", "model.preset=small", "model.architecture=qwen3_moe", "data.task=arithmetic",
        "data.num_train_rows=2000", "data.num_val_rows=8", "rollout.max_model_len=96",
        "rollout.sampling.num_samples_per_prompt=8", "rollout.sampling.max_response_tokens=32",
        "rollout.sampling.seed=0", "rollout.validation_sampling.max_response_tokens=8",
        f"reward.custom_function={HERE / 'digit_reward.py'}:compute_score", f"trainer.optim.lr={lr}",
        "pipeline.mode=async", "buffer.max_staleness=2", "buffer.staleness_threshold=2.0", "rollout.partial_rollout=true",
        "rollout.record_routing=true", f"trainer.routing_replay={'rollout' if replay else 'trainer'}",
        "rollout.cpu_cores=[0]", "trainer.cpu_cores=[1]", f"pipeline.num_steps={num_steps}",
        "pipeline.batch_size_prompts=16", "pipeline.val_every_steps=0", f"pipeline.output_dir={output_dir}",
        "pipeline.resume=never", "pipeline.seed=0",
    ]


def run(model_path: Path, work: Path, num_steps: int, replay: bool, lr: float) -> dict:
    config = load_config(None, overrides(model_path, work / ("on" if replay else "off"), num_steps, replay, lr))
    timed = [h for h in run_pipeline(config) if h["step"] > 0][NUM_WARMUP_STEPS:]
    mean = lambda key: statistics.mean(h.get(key, 0.0) for h in timed)  # noqa: E731
    return {
        "routing_mismatch_share": round(mean("actor/routing_mismatch_share"), 4),
        "log_ratio_abs_mean": round(mean("rollout/logprob_abs_diff_mean"), 5),
        "log_ratio_abs_max": round(max(h["rollout/logprob_abs_diff_max"] for h in timed), 4),
        "clip_fraction": round(mean("actor/pg_clipfrac"), 5),
        "step_s": round(mean("timing_s/step"), 4),
        "staleness_max": max(h["staleness/max"] for h in timed),
        "staleness_mean": round(mean("staleness/mean"), 3),
        "reward": round(statistics.mean(h["reward/mean"] for h in timed[-3:]), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-steps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=2e-4,
                        help="the actor's learning rate: how far two versions' weights (and routers) move apart")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="moe_replay_"))
    model_path = build_tiny_model(work / "model", "small", seed=0, architecture="qwen3_moe")
    results = {}
    for name, replay in (("off", False), ("on", True)):
        results[name] = run(model_path, work, args.num_steps, replay, args.lr)
        print(name, json.dumps(results[name]), flush=True)
    off, on = results["off"], results["on"]
    print(json.dumps({
        "num_steps": args.num_steps,
        "lr": args.lr,
        "replay_off": off,
        "replay_on": on,
        "replay_ratio_error_reduction": round(off["log_ratio_abs_mean"] / max(on["log_ratio_abs_mean"], 1e-12), 3),
        "step_time_cost": round(on["step_s"] / off["step_s"] - 1, 3),
    }))


if __name__ == "__main__":
    main()
