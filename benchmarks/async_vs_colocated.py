"""Fully-async vs colocated: the same GRPO config on the `small` model, equal numbers of steps, one run.

Colocated lets rollout and training take turns on both cores; async gives the rollout engine and
the trainer one core each (`rollout.cpu_cores`, `trainer.cpu_cores`) and overlaps them, with one
batch of look-ahead (staleness_threshold 1, max_staleness 1, partial rollouts, truncated IS).
The reward is a toy one an untrained model can learn (the share of digits in the response), so
the final rewards say whether both modes learn alike.

    .venv/bin/python benchmarks/async_vs_colocated.py [--num-steps 20]

Prints one final JSON line: colocated_step_s, async_step_s (medians, first step excluded),
speedup, colocated_reward, async_reward (mean training reward of the last 5 steps).
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


def run_mode(mode: str, model_path: Path, output_dir: Path, num_steps: int) -> list[dict]:
    common = [
        f"model.path={model_path}", "model.preset=small", "data.task=arithmetic", "data.num_train_rows=2000",
        "data.num_val_rows=32", "rollout.max_model_len=64", "rollout.sampling.num_samples_per_prompt=8",
        "rollout.sampling.max_response_tokens=16", "rollout.validation_sampling.max_response_tokens=16",
        f"reward.custom_function={HERE / 'digit_reward.py'}:compute_score",
        "trainer.optim.lr=5e-4", f"pipeline.num_steps={num_steps}", "pipeline.batch_size_prompts=16",
        "pipeline.val_every_steps=0", f"pipeline.output_dir={output_dir / mode}", "pipeline.resume=never",
        f"pipeline.mode={mode}",
    ]
    if mode == "async":
        common += ["buffer.staleness_threshold=1.0", "buffer.max_staleness=1", "rollout.partial_rollout=true",
                   "algorithm.rollout_correction.importance_level=token", "rollout.cpu_cores=[0]", "trainer.cpu_cores=[1]"]
    return run_pipeline(load_config(None, common))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-steps", type=int, default=20)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="async_vs_colocated_"))
    model_path = build_tiny_model(work / "model", "small", seed=0)
    results = {}
    for mode in ("colocated", "async"):
        history = [h for h in run_mode(mode, model_path, work, args.num_steps) if h["step"] > 0]
        results[mode] = {
            "step_s": statistics.median(h["timing_s/step"] for h in history[1:]),
            "reward": statistics.mean(h["reward/mean"] for h in history[-5:]),
            "first_reward": history[0]["reward/mean"],
            "staleness_max": max(h["staleness/max"] for h in history),
        }
        print(mode, json.dumps(results[mode]), flush=True)
    colocated, fully_async = results["colocated"], results["async"]
    print(json.dumps({
        "num_steps": args.num_steps,
        "colocated_step_s": round(colocated["step_s"], 4),
        "async_step_s": round(fully_async["step_s"], 4),
        "speedup": round(colocated["step_s"] / fully_async["step_s"], 3),
        "colocated_reward": round(colocated["reward"], 4),
        "async_reward": round(fully_async["reward"], 4),
        "colocated_first_reward": round(colocated["first_reward"], 4),
        "async_first_reward": round(fully_async["first_reward"], 4),
        "async_staleness_max": fully_async["staleness_max"],
    }))


if __name__ == "__main__":
    main()
