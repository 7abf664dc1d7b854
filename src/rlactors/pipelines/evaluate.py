"""Evaluation without training: `python -m rlactors eval CONFIG|MODEL_DIR [key=value ...]`.

The run's rollout engines and reward scorers over its validation set, with its validation sampling,
as the training loop validates (`score_requests`):

    output_dir/eval/report.json       model, prompts, sampling, and per data source `acc` (greedy:
                                      pass@1; sampled: mean@n) and pass@k for n > 1
    output_dir/eval/samples.parquet   one row per response: prompt, response, score, accuracy

For pass@k, sample: `rollout.validation_sampling.num_samples_per_prompt=8
rollout.validation_sampling.temperature=0.7`. A model folder (an export under output_dir/hf, any
Hugging Face folder) stands for a config with that `model.path` and `pipeline.output_dir`
outputs/eval/<folder name>.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlactors.config import Config, ConfigError, load_config
from rlactors.models import ensure_run_model, load_tokenizer
from rlactors.pipelines import preflight
from rlactors.pipelines.batch_builder import BatchBuilder
from rlactors.pipelines.build import data_files, init_ray
from rlactors.pipelines.common import score_requests
from rlactors.pipelines.teardown import run_parts, stop_all
from rlactors.reward.pool import RewardPool
from rlactors.rollout.router import RolloutRouter
from rlactors.runtime.durable import write_durably


def eval_config(target: str, overrides: list[str]) -> Config:
    """The config of `target`: a YAML file, or a model folder (config.json inside) as `model.path`."""
    path = Path(target)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{path}: a folder to evaluate is a Hugging Face model folder, and holds no config.json")
        # Its own output folder by default: never the data or logs of a training run (outputs/run).
        return load_config(None, [f"model.path={path.absolute()}", "model.build_if_missing=false",
                                  f"pipeline.output_dir=outputs/eval/{path.absolute().name}", *overrides])
    return load_config(path, overrides)


def run_eval(config: Config) -> dict:
    """Evaluate `config.model` on the validation set; returns the report it writes."""
    output_dir = Path(config.pipeline.output_dir).absolute()
    folder = output_dir / "eval"
    folder.mkdir(parents=True, exist_ok=True)
    model_path = str(ensure_run_model(config.model, output_dir))
    preflight.check_model(config, model_path)
    tokenizer = load_tokenizer(model_path)
    _, val_files = data_files(config, output_dir)
    requests = preflight.check_prompts(config, tokenizer, [], [], val_files)  # a bad row names its file
    if not requests:
        raise ConfigError(f"data.val_files: no validation prompts in {val_files}")
    init_ray(output_dir / "logs", config.pipeline.verbose)
    router = reward = builder = None
    try:
        router = RolloutRouter.create(model_path, config.rollout, max_restarts=1, dtype=config.model.dtype)
        router.ready()
        reward = RewardPool(config.reward, max_response_tokens=config.rollout.validation_sampling.max_response_tokens,
                            policy_tokenizer_path=model_path)
        builder = BatchBuilder.remote(config.algorithm, model_path)
        metrics = score_requests(router, reward, builder, requests, config, folder / "samples.parquet")
    finally:
        stop_all(run_parts((), router, reward, None, builder))
    report = {"model": model_path, "val_files": val_files, "num_prompts": len(requests),
              "sampling": config.rollout.validation_sampling.model_dump(),
              "metrics": {f"val/{name}": value for name, value in metrics.items()}}
    write_durably(folder / "report.json", (json.dumps(report, indent=2) + "\n").encode())
    for name, value in report["metrics"].items():
        print(f"{name}: {value:.4g}")
    print(f"report: {folder / 'report.json'}\nsamples: {folder / 'samples.parquet'}")
    return report
