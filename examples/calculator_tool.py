"""Multi-turn tool use on CPU: the `small` char model learns to call a calculator, then GRPO.

    python examples/calculator_tool.py [--steps N] [--sft-steps N] [--output DIR] [--smoke]

`37*58=` (2-3 digit factors) is beyond a ~3M-parameter model's head, but not with a tool:

    prompt 37*58=   model [calc 37*58]   calculator =2146\\n   model 2146<|endoftext|>

1. Build the random-init `small` model.
2. Supervised warm-up on that format (`TrainerGroup.sft_step`): the observation tokens are context
   only (loss mask 0), exactly the text the calculator environment returns. Short on purpose: the
   model learns the format but still copies digits wrong, leaving GRPO something to fix.
3. GRPO through the real stack (vLLM rollout with the calculator environment, reward actors, FSDP2
   trainer), greedy validation on held-out problems before the first step and after the last.
4. A summary JSON line: accuracy and the share of validation episodes that called the tool.

Measured on 2 CPU cores (defaults: 35 warm-up steps, 20 GRPO steps): held-out greedy accuracy
0.36 -> 0.65, every validation episode calls the tool, ~5 min. With 150 warm-up steps the model
starts at 0.80 and 20 GRPO steps do not improve it (0.76): the warm-up must stop early.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import ray
import torch

from rlactors.config import load_config
from rlactors.data.synthetic import calculator_rows
from rlactors.environments.calculator import CalculatorEnvironment
from rlactors.environments.protocol import ToolCall, Turn
from rlactors.models import ensure_run_model, load_tokenizer
from rlactors.pipelines import run_pipeline
from rlactors.pipelines.build import init_ray, seed_everything
from rlactors.trainer.batch import LOSS_MASK, TrainBatch
from rlactors.trainer.group import TrainerGroup

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "src" / "rlactors" / "configs" / "demo.yaml"
KEY = "val/synthetic/calculator/acc"


def demo_batch(rows: list[dict], tokenizer) -> TrainBatch:
    """`[calc a*b]` (model) + the calculator's own answer (observation, mask 0) + `a*b` EOS (model)."""
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompts, responses, masks = [], [], []
    for row in rows:
        expression, answer = row["prompt"][0]["content"].rstrip("="), row["reward_model"]["ground_truth"]
        call = f"[calc {expression}]"
        observation = CalculatorEnvironment().step(Turn(call, [ToolCall("calc", {"input": expression})], 0, "stop"))
        parts = [(ids(call), 1), (ids(observation.observation), 0), (ids(answer) + [tokenizer.eos_token_id], 1)]
        prompts.append(ids(row["prompt"][0]["content"]))
        responses.append([t for tokens, _ in parts for t in tokens])
        masks.append(torch.tensor([m for tokens, m in parts for _ in tokens], dtype=torch.float32))
    return TrainBatch(prompt_token_ids=prompts, response_token_ids=responses, group_ids=list(range(len(rows))),
                      token_fields={LOSS_MASK: masks})


def warm_up(config, model_path: Path, output_path: Path, num_steps: int, batch_size: int, num_demos: int) -> Path:
    rows = calculator_rows(num_demos, seed=config.data.seed, split="train")  # the pipeline's own train split
    tokenizer = load_tokenizer(model_path)
    trainer = config.trainer.model_copy(update={"num_mini_batches": 1, "optim": config.trainer.optim.model_copy(
        update={"lr": 1e-3, "warmup_steps": 0, "lr_schedule": "constant"})})
    actor = TrainerGroup("actor", str(model_path), trainer, config.algorithm, seed=config.pipeline.seed)
    try:
        generator = torch.Generator().manual_seed(config.pipeline.seed)
        for step in range(1, num_steps + 1):
            picks = torch.randint(len(rows), (batch_size,), generator=generator).tolist()
            metrics = actor.sft_step(demo_batch([rows[i] for i in picks], tokenizer))
            if step % 25 == 0 or step == num_steps:
                print(f"warm-up step {step}/{num_steps}: loss {metrics['actor/sft_loss']:.3f}", flush=True)
        actor.save_hf(str(output_path))
    finally:
        actor.shutdown()
    return output_path


def tool_use_share(output_dir: Path, step: int) -> float:
    """Share of the validation episodes of `step` that made at least one tool call."""
    calls = pq.read_table(output_dir / "validation" / f"step_{step}.parquet").column("num_tool_calls").to_pylist()
    return sum(c > 0 for c in calls) / len(calls)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps")
    parser.add_argument("--sft-steps", type=int, default=35, help="supervised warm-up steps")
    parser.add_argument("--output", default="outputs/calculator_tool")
    parser.add_argument("--smoke", action="store_true", help="1 warm-up step, 1 GRPO step, tiny sizes (tests)")
    args = parser.parse_args(argv)
    steps, sft_steps = (1, 1) if args.smoke else (args.steps, args.sft_steps)
    sizes = ({"rows": 32, "val": 4, "prompts": 2, "samples": 2, "demos": 32, "batch": 8} if args.smoke else
             {"rows": 2000, "val": 100, "prompts": 16, "samples": 8, "demos": 1000, "batch": 64})
    output = Path(args.output)
    started = time.perf_counter()
    common = [
        f"pipeline.output_dir={output / 'grpo'}", "data.task=calculator", f"data.num_train_rows={sizes['rows']}",
        f"data.num_val_rows={sizes['val']}", "rollout.max_model_len=96", "rollout.environment.max_turns=2",
        "rollout.environment.max_turn_tokens=16", "rollout.environment.tool_call_format=plain",
        "rollout.sampling.max_response_tokens=40", "rollout.validation_sampling.max_response_tokens=40",
        f"rollout.sampling.num_samples_per_prompt={sizes['samples']}", f"pipeline.batch_size_prompts={sizes['prompts']}",
        f"pipeline.num_steps={steps}", "pipeline.val_every_steps=0", "pipeline.resume=never",
    ]
    # 1. The random-init small model (demo.yaml: preset small, build_if_missing).
    config = load_config(DEMO_CONFIG, common + [f"model.path={output / 'base_model'}"])
    seed_everything(config.pipeline.seed)
    init_ray(output.absolute() / "logs", config.pipeline.verbose)
    base = ensure_run_model(config.model, output)
    # 2. Supervised warm-up on the call format.
    warm = warm_up(config, base, output / "warm_model", sft_steps, sizes["batch"], sizes["demos"])
    warm_s = time.perf_counter() - started
    print(f"warm-up done in {warm_s:.0f} s; GRPO starts from {warm}", flush=True)
    # 3. GRPO from the warmed-up folder (a model folder is never rebuilt: build_if_missing off).
    grpo = load_config(DEMO_CONFIG, common + [f"model.path={warm}", "model.build_if_missing=false"])
    history = run_pipeline(grpo)
    ray.shutdown()
    grpo_dir = Path(grpo.pipeline.output_dir)
    summary = {
        "accuracy_before": history[0][KEY], "accuracy_after": history[-1][KEY],
        "tool_use_share_before": tool_use_share(grpo_dir, 0), "tool_use_share_after": tool_use_share(grpo_dir, steps),
        "train_tool_calls_mean_first": history[1].get("episode/tool_calls_mean"),
        "train_reward_first": history[1].get("reward/mean"), "train_reward_last": history[-1].get("reward/mean"),
        "steps": steps, "sft_steps": sft_steps, "warm_up_seconds": round(warm_s, 1),
        "seconds": round(time.perf_counter() - started, 1), "model": str(warm),
        "final_model": str(grpo_dir / "hf" / f"step_{steps}"),
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
