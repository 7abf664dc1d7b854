"""Command line: `python -m rlactors <command>` (also the `rlactors` console script).

    run CONFIG.yaml [key=value ...]   train (GRPO/DAPO/PPO, colocated or async) as the config says
    demo [key=value ...]              the CPU demo: warm up the small model on arithmetic, then GRPO
         (run and demo: --verbose shows every INFO line of vLLM, Ray and transformers)
    eval CONFIG|MODEL_DIR [key=value] the engines and reward scorers over the validation set, no training:
                                      output_dir/eval/report.json and samples.parquet
    export CHECKPOINT OUT [--model M] a saved checkpoint's actor as a Hugging Face folder at OUT
    plot METRICS.jsonl [-o OUT.png]   draw a metrics file
    train-reward-model [CONFIG] [k=v] a classifier reward model trained on preference pairs (Bradley-Terry),
                                      written as the Hugging Face folder `reward.models` loads
    smoke                             build the tiny model and generate through vLLM once
    check-vllm                        what the installed vLLM offers the rollout engine; exit 1 if it lacks a call
    plan CONFIG.yaml [key=value ...]  where every role runs, memory per device, whether it fits
         [--nodes N --devices-per-node G] [--cpus-per-node C] [--device-memory-gib M] [--json]
    config [CONFIG.yaml] [key=value]  print the resolved configuration as YAML
    fields                            list every setting with its description

Under `ray job submit ... -- python -m rlactors run ...` Ray connects to the job's cluster; set
RAY_ADDRESS to submit to a cluster yourself. Without a cluster a local Ray is started.

An error the product names (a bad setting or data row, a plan that does not fit, a run stopped by
a failing actor or scorer) is one `error: ...` line on stderr, exit status 2 for input refused
before anything ran and 1 for a run that stopped (its traceback goes to the run's driver log);
any other error is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys


def _smoke() -> int:
    import os
    import tempfile

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from rlactors.models import build_tiny_model, load_tokenizer

    path = build_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny"), preset="tiny", seed=0)
    tokenizer = load_tokenizer(path)
    llm = LLM(str(path), dtype="float32", enforce_eager=True, max_model_len=128, gpu_memory_utilization=0.1, seed=0)
    prompts = ["12+34=", "7+8="]
    outputs = llm.generate([{"prompt_token_ids": tokenizer(p)["input_ids"]} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=8, logprobs=0))
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        print(f"{prompt!r} -> {completion.text!r} ({len(completion.token_ids)} tokens, "
              f"sum logprob {sum(d[t].logprob for d, t in zip(completion.logprobs, completion.token_ids, strict=True)):.2f})")
    print(f"smoke run OK: tiny model at {path} generated through vLLM")
    return 0


def _export(checkpoint: str, out: str, model: str | None, dtype_name: str | None) -> int:
    import torch

    from rlactors.trainer.hf_export import export_checkpoint

    dtype = getattr(torch, dtype_name, None) if dtype_name else None
    if dtype_name and not isinstance(dtype, torch.dtype):
        print(f"error: --dtype {dtype_name!r} is not a torch dtype (bfloat16, float16, float32)", file=sys.stderr)
        return 2
    try:
        print(f"model: {export_checkpoint(checkpoint, out, model, dtype)} (Hugging Face folder)")
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlactors", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="train as CONFIG says")
    run.add_argument("config")
    run.add_argument("overrides", nargs="*", help="dotted.key=value")
    demo = commands.add_parser("demo", help="the CPU demo")
    demo.add_argument("overrides", nargs="*")
    evaluate = commands.add_parser("eval", help="evaluate a model on the validation set")
    evaluate.add_argument("target", help="a run's config YAML, or a Hugging Face model folder")
    evaluate.add_argument("overrides", nargs="*", help="dotted.key=value")
    for command in (run, demo, evaluate):
        command.add_argument("--verbose", action="store_true",
                             help="every INFO line of vLLM, Ray and transformers on the terminal (pipeline.verbose)")
    export = commands.add_parser("export", help="a checkpoint's actor as a Hugging Face folder")
    export.add_argument("checkpoint", help="a run's output_dir, its checkpoints/ folder, or one checkpoint step_N")
    export.add_argument("out", help="the Hugging Face folder to write (replaced once the new one is whole)")
    export.add_argument("--model", default=None, help="model folder for config and tokenizer (default: the run's)")
    export.add_argument("--dtype", default=None, help="dtype of the weights (default: the model config's)")
    plot = commands.add_parser("plot", help="draw a metrics.jsonl file")
    plot.add_argument("metrics")
    plot.add_argument("-o", "--output", default=None)
    train_reward = commands.add_parser("train-reward-model", help="a reward model (classifier) trained on preference "
                                       "pairs, written as the folder reward.models loads")
    train_reward.add_argument("config", nargs="?", help="YAML of a RewardTrainingConfig (or only key=value overrides)")
    train_reward.add_argument("overrides", nargs="*", help="dotted.key=value")
    commands.add_parser("smoke", help="tiny model through vLLM once")
    commands.add_parser("check-vllm", help="what the installed vLLM offers the rollout engine; exit 1 if it lacks a call")
    show = commands.add_parser("config", help="print the resolved configuration")
    show.add_argument("config", nargs="?")
    show.add_argument("overrides", nargs="*")
    commands.add_parser("fields", help="list every setting")
    plan = commands.add_parser("plan", help="lay the run out on a cluster; exit 2 if it does not fit")
    plan.add_argument("config")
    plan.add_argument("overrides", nargs="*", help="dotted.key=value")
    plan.add_argument("--nodes", type=int, default=None, help="nodes of a cluster to plan for (default: the live one)")
    plan.add_argument("--devices-per-node", type=int, default=None, help="GPUs per node (0: a CPU cluster)")
    plan.add_argument("--cpus-per-node", type=float, default=None, help="CPUs per node (default: not checked)")
    plan.add_argument("--device-memory-gib", type=float, default=None, help="memory of one GPU, for the fit check")
    plan.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    return parser


def _config_and_overrides(args) -> tuple[str | None, list[str]]:
    """(config file or None, overrides) of a command whose config file is optional: a first
    argument with '=' in it is an override."""
    if args.config and "=" in args.config:
        return None, [args.config, *args.overrides]
    return args.config, args.overrides


def main(argv: list[str] | None = None) -> int:
    commands = parser()
    args, extra = commands.parse_known_args(argv)
    # Overrides may follow options (`plan CONFIG --nodes 4 model.path=...`), which argparse leaves over.
    if extra and hasattr(args, "overrides") and all("=" in item and not item.startswith("-") for item in extra):
        args.overrides += extra
    elif extra:
        commands.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "verbose", False):
        args.overrides.append("pipeline.verbose=true")

    from rlactors.config import describe_fields, dump_config, load_config

    try:
        if args.command == "plot":
            from rlactors.metrics import plot_metrics

            print(plot_metrics(args.metrics, args.output))
            return 0
        if args.command == "eval":
            from rlactors.pipelines.evaluate import eval_config, run_eval

            run_eval(eval_config(args.target, args.overrides))
            return 0
        if args.command == "export":
            return _export(args.checkpoint, args.out, args.model, args.dtype)
        if args.command == "smoke":
            return _smoke()
        if args.command == "fields":
            for path, description in describe_fields():
                print(f"{path:45s} {description}")
            return 0
        if args.command == "config":
            print(dump_config(load_config(*_config_and_overrides(args))), end="")
            return 0
        if args.command == "train-reward-model":
            from rlactors.config import RewardTrainingConfig
            from rlactors.pipelines.reward_model_training import train_reward_model

            train_reward_model(load_config(*_config_and_overrides(args), model=RewardTrainingConfig))
            return 0
        if args.command == "check-vllm":
            from rlactors.runtime.vllm_features import main as check_vllm

            return check_vllm()
        if args.command == "plan":
            from rlactors.placement.report import plan_main

            return plan_main(load_config(args.config, args.overrides), args.nodes, args.devices_per_node,
                             args.cpus_per_node, args.device_memory_gib, args.json)
        if args.command == "run":
            from rlactors.pipelines import run_pipeline

            run_pipeline(load_config(args.config, args.overrides))
            return 0
        if args.command == "demo":
            from rlactors.demo import run_demo

            return run_demo(args.overrides)
    except Exception as error:
        status = exit_status(error)
        if status is None:
            raise  # not an error the product names: its traceback is the report
        logging.getLogger(__name__).info("the error in full", exc_info=error)  # the run's driver log, if it has one
        if status == 1:
            from rlactors.runtime.calls import error_text

            error = error_text(error)  # the cause's own text, not Ray's wrapping of it
        print(f"error: {error}", file=sys.stderr)
        return status
    return 1


def exit_status(error: BaseException) -> int | None:
    """2 for input refused before anything ran (a setting, a data row, a plan that does not fit),
    1 for a run the product stopped with an error naming its cause (an actor that failed or did not
    answer, scoring or rollouts failing everywhere); None for any other error."""
    import ray

    from rlactors.buffer.records import DynamicSamplingExhausted, RolloutErrorsExhausted
    from rlactors.config import ConfigError
    from rlactors.data import DataError
    from rlactors.pipelines.checkpointing import CheckpointWriteError
    from rlactors.placement.plan import PlanError
    from rlactors.reward.failures import ScoringFailedError
    from rlactors.rollout.faults import EngineStartError, NoLiveEngineError
    from rlactors.trainer.ranks import TrainerRankError
    from rlactors.weight_sync.client import WeightSyncError

    if isinstance(error, ConfigError | DataError | PlanError):
        return 2
    if isinstance(error, ScoringFailedError | CheckpointWriteError | RolloutErrorsExhausted | DynamicSamplingExhausted | NoLiveEngineError
                  | EngineStartError | TrainerRankError | WeightSyncError | TimeoutError | ray.exceptions.RayActorError):
        return 1
    return None
