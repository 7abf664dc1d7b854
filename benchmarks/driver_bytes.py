"""Bytes the driver process receives per training step, against the step's rollout bytes.

Runs the tiny model for a few GRPO steps, colocated and fully async, with everything the driver
receives counted by `received_bytes.DriverBytes` (beside this script): every `ray.get` and every call result that
came inline in a reply. A step's rollout bytes are the serialized size of the Groups it trains
(the buffer's object holding them, sized by its owner; nothing is fetched). A step's driver bytes
are those received between two metrics log lines: generation, scoring, buffering, the batch, the
update and the weight sync; validation (before the first step and after the last) is counted
apart. The target: under 5% of the rollout bytes. What the driver receives grows with the number
of groups (summaries, ids, per-sample numbers) and not with their tokens, so the share falls as
responses get longer: `driver_bytes_per_group` and `rollout_bytes_per_token` scale it.

    .venv/bin/python benchmarks/driver_bytes.py [--num-steps 3] [--num-response-tokens 256]

Prints a line per mode with every figure (per step, per group, per token, validation, bytes by
source), then one final JSON line: per mode driver_bytes_share (driver bytes over rollout bytes,
all steps), driver_bytes_per_step, rollout_bytes_per_step and the rollout values the driver read
by value (empty when none); target 0.05 and meets_target.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from received_bytes import DriverBytes, object_size

from rlactors.config import load_config
from rlactors.metrics import MetricsLogger
from rlactors.models import build_tiny_model
from rlactors.pipelines import colocated, common, fully_async, run_pipeline

HERE = Path(__file__).resolve().parent
TARGET_SHARE = 0.05


def config_for(mode: str, model_path: Path, output_dir: Path, args) -> object:
    overrides = [
        f"model.path={model_path}", "model.preset=tiny", "data.task=arithmetic", "data.num_train_rows=256",
        "data.num_val_rows=8", f"rollout.max_model_len={args.num_response_tokens + 64}",
        f"rollout.sampling.num_samples_per_prompt={args.num_samples}",
        f"rollout.sampling.max_response_tokens={args.num_response_tokens}", "rollout.sampling.ignore_eos=true",
        "rollout.validation_sampling.num_samples_per_prompt=1", "rollout.validation_sampling.temperature=0",
        "rollout.validation_sampling.max_response_tokens=16",
        f"reward.custom_function={HERE / 'digit_reward.py'}:compute_score",
        f"pipeline.num_steps={args.num_steps}", f"pipeline.batch_size_prompts={args.batch_size}",
        "pipeline.val_every_steps=0", f"pipeline.output_dir={output_dir / mode}", "pipeline.resume=never",
        f"pipeline.mode={mode}",
    ]
    if mode == "async":
        overrides += ["buffer.staleness_threshold=1.0", "buffer.max_staleness=1"]
    return load_config(None, overrides)


def measure(mode: str, model_path: Path, output_dir: Path, args) -> dict:
    """Run `mode` with the driver's receipts counted; per step: driver bytes and rollout bytes."""
    driver_bytes: dict[int, int] = {}  # metrics line (step) -> bytes received since the previous one
    rollout_bytes: list[int] = []
    validation_bytes: list[int] = []
    unlogged = [0]  # bytes received since the last metrics line, outside validation
    log, validate, prepare = MetricsLogger.log, common.validate, {m: m.prepare_batch for m in (colocated, fully_async)}

    with DriverBytes() as received:
        def logged(logger, step, metrics):
            driver_bytes[step] = unlogged[0] + received.flush()["bytes"]
            unlogged[0] = 0
            return log(logger, step, metrics)

        def validate_apart(run):
            unlogged[0] += received.flush()["bytes"]
            metrics = validate(run)
            validation_bytes.append(received.flush()["bytes"])
            return metrics

        def sized(prepare_batch):
            def prepare_batch_sized(run, sampled):
                rollout_bytes.append(object_size(sampled.groups_ref))
                return prepare_batch(run, sampled)
            return prepare_batch_sized

        MetricsLogger.log = logged
        common.validate = validate_apart
        for module, original in prepare.items():
            module.prepare_batch = sized(original)
        try:
            run_pipeline(config_for(mode, model_path, output_dir, args))
        finally:
            MetricsLogger.log, common.validate = log, validate
            for module, original in prepare.items():
                module.prepare_batch = original
    per_step = [driver_bytes[step] for step in sorted(driver_bytes) if step > 0]
    num_tokens = args.batch_size * args.num_samples * args.num_response_tokens
    return {
        "driver_bytes_per_step": per_step,
        "rollout_bytes_per_step": rollout_bytes,
        "driver_bytes_share": round(sum(per_step) / max(sum(rollout_bytes), 1), 5),
        "max_step_share": round(max(d / max(r, 1) for d, r in zip(per_step, rollout_bytes, strict=True)), 5),
        "driver_bytes_per_group": round(sum(per_step) / len(per_step) / args.batch_size),
        "rollout_bytes_per_token": round(sum(rollout_bytes) / len(rollout_bytes) / num_tokens, 2),
        "setup_bytes": driver_bytes.get(0, 0),
        "validation_bytes": validation_bytes,
        "largest_read": list(received.largest_read),
        "rollout_values_read": dict(received.rollout_types_read),
        "bytes_by_source": dict(received.bytes_by_source.most_common()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per step")
    parser.add_argument("--num-samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--num-response-tokens", type=int, default=256)
    parser.add_argument("--modes", default="colocated,async")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="driver_bytes_"))
    model_path = build_tiny_model(work / "model", "tiny", seed=0)
    results = {}
    for mode in args.modes.split(","):
        results[mode] = measure(mode, model_path, work, args)
        print(mode, json.dumps(results[mode]), flush=True)
    print(json.dumps({
        "num_steps": args.num_steps,
        "tokens_per_step": args.batch_size * args.num_samples * args.num_response_tokens,
        **{f"{mode}_driver_bytes_share": result["driver_bytes_share"] for mode, result in results.items()},
        **{f"{mode}_driver_bytes_per_step": round(sum(r["driver_bytes_per_step"]) / len(r["driver_bytes_per_step"]))
           for mode, r in results.items()},
        **{f"{mode}_rollout_bytes_per_step": round(sum(r["rollout_bytes_per_step"]) / len(r["rollout_bytes_per_step"]))
           for mode, r in results.items()},
        **{f"{mode}_rollout_values_read": r["rollout_values_read"] for mode, r in results.items()},
        "target": TARGET_SHARE,
        "meets_target": all(r["driver_bytes_share"] < TARGET_SHARE for r in results.values()),
    }))


if __name__ == "__main__":
    main()
