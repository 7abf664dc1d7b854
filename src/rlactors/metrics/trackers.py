"""The backends `MetricsLogger` fans each step out to, one small class each with `log(step, metrics)`
and `close()`: jsonl (always), TensorBoard, Weights & Biases and MLflow.

Every backend gets the same metric names (`reward/mean`, `val/<source>/acc`, ...) and the step as
its step. The resolved config (a plain dict, `config.model_dump(mode="json")`) is logged once at
the start: wandb `config=`, mlflow params under dotted keys, TensorBoard a YAML text; jsonl nothing
(the run writes output_dir/config.yaml). wandb and mlflow are the `trackers` extra; a named tracker
whose package does not import is an error at start, never skipped.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rlactors.config import DEFAULT_LOGGERS, ConfigError

INSTALL = "pip install 'rlactors[trackers]'"
_MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
# mlflow's limits (mlflow.utils.validation): characters of a param value, entries per log_batch call.
_MLFLOW_PARAM_CHARS = 6000
_MLFLOW_PARAMS_PER_BATCH = 100
_MLFLOW_METRICS_PER_BATCH = 1000


class TrackerError(ConfigError):
    """A tracker in `pipeline.loggers` cannot run (unknown, or its package is not installed)."""


def check_installed(names: Sequence[str]) -> None:
    """Import the package of every named tracker, so that a missing one fails before the run
    starts; and refuse an online wandb with no API key, which would wait for one on the terminal."""
    for name in names:
        _import(name, names)
    if "wandb" in names and wandb_needs_login():
        raise TrackerError("pipeline.loggers names 'wandb' online (WANDB_MODE unset or online) but no API key is "
                           "configured (WANDB_API_KEY, or `wandb login`): wandb would wait for one on the terminal; "
                           "set WANDB_MODE=offline to log under output_dir/wandb and `wandb sync` later")


def wandb_needs_login() -> bool:
    """Online wandb without a key in WANDB_API_KEY or ~/.netrc (where `wandb login` puts it)."""
    import netrc
    from urllib.parse import urlparse

    if os.environ.get("WANDB_MODE", "online") in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return False
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host) is None
    except (OSError, netrc.NetrcParseError):
        return True


def _import(name: str, names: Sequence[str]) -> Any:
    """The tracker's module; None for jsonl, and for TensorBoard missing when the list is the default
    one (skipped, as before trackers could be chosen)."""
    if name == "jsonl":
        return None
    if name not in _MODULES:
        raise TrackerError(f"pipeline.loggers: unknown tracker {name!r}; known: jsonl, {', '.join(_MODULES)}")
    try:
        return importlib.import_module(_MODULES[name])
    except ImportError as error:
        if name == "tensorboard" and set(names) == set(DEFAULT_LOGGERS):
            return None
        extra = INSTALL if name != "tensorboard" else "pip install tensorboard"
        raise TrackerError(f"pipeline.loggers names {name!r}, but {_MODULES[name]} does not import ({error}); "
                           f"install it with `{extra}` or remove {name!r} from pipeline.loggers") from None


def open_trackers(names: Sequence[str], output_dir: Path, *, append: bool, config: dict, project: str,
                  run_name: str) -> list:
    """Start each named tracker; if one fails, close those already started and raise."""
    if "jsonl" not in names:
        raise TrackerError("pipeline.loggers must include 'jsonl' (the driver reads metrics.jsonl back for the plot)")
    config = json.loads(json.dumps(config, default=str))  # tuples to lists, anything odd to text: YAML- and JSON-safe
    modules = {name: _import(name, names) for name in dict.fromkeys(names)}  # all, before any tracker starts
    started: list = []
    try:
        for name, module in modules.items():
            if name == "jsonl":
                started.append(JsonlTracker(output_dir / "metrics.jsonl", append))
            elif module is None:
                continue
            elif name == "tensorboard":
                started.append(TensorBoardTracker(module, output_dir / "tensorboard", config))
            elif name == "wandb":
                started.append(WandbTracker(module, output_dir, config, project, run_name))
            else:
                started.append(MlflowTracker(module, output_dir, config, project, run_name))
    except BaseException:
        with contextlib.suppress(Exception):  # the error that stopped the start is the one to see
            close_all(started)
        raise
    return started


def close_all(trackers: Sequence) -> None:
    """Close every tracker even if one fails (a crashed tracker must not keep the others' files open)."""
    errors = []
    for tracker in trackers:
        try:
            tracker.close()
        except Exception as error:  # re-raised below, once every tracker had its turn
            errors.append(error)
    if errors:
        raise errors[0]


def scalars(metrics: dict) -> dict[str, float]:
    """The finite numbers of a record: what every tracker but jsonl can plot."""
    return {k: v for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


def flatten(tree: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(`trainer.optim.lr`, 5e-4) for every leaf of a nested dict."""
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def mlflow_name(key: str) -> str:
    """The metric name mlflow accepts (letters, digits, `_-./: `): `val/gsm8k/pass@4` becomes
    `val/gsm8k/pass_at_4`, any other character `_`. The only place names differ between trackers."""
    return re.sub(r"[^\w\-./: ]", "_", key.replace("@", "_at_"))


class JsonlTracker:
    """One JSON object per step (the step under key "step"), every value as given, flushed each step."""

    def __init__(self, path: Path, append: bool):
        self._file = open(path, "a" if append else "w")

    def log(self, step: int, metrics: dict) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardTracker:
    def __init__(self, module: Any, log_dir: Path, config: dict):
        import yaml

        self._writer = module.SummaryWriter(str(log_dir))
        if config:
            # Indented four spaces: TensorBoard renders text as Markdown, where that is a code block.
            text = yaml.safe_dump(config, sort_keys=False)
            self._writer.add_text("config", "".join(f"    {line}\n" for line in text.splitlines()))

    def log(self, step: int, metrics: dict) -> None:
        for key, value in scalars(metrics).items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A wandb run in output_dir/wandb. The mode is wandb's own reading of WANDB_MODE (offline: nothing
    leaves the machine; `wandb sync output_dir/wandb/offline-run-*` uploads later)."""

    def __init__(self, wandb: Any, output_dir: Path, config: dict, project: str, run_name: str):
        self._wandb = wandb
        self._run = wandb.init(project=project, name=run_name, dir=str(output_dir), config=config)

    def log(self, step: int, metrics: dict) -> None:
        self._run.log(scalars(metrics), step=step)

    def close(self) -> None:
        self._run.finish()
        if self._wandb.run is None:  # no other run of this process needs wandb's service process
            self._wandb.teardown()


class MlflowTracker:
    """An mlflow run in experiment `project`, at MLFLOW_TRACKING_URI or else a local store in
    output_dir/mlruns. That local store is mlflow's file store: its sqlite store needs sqlalchemy,
    which mlflow-skinny does not install, and mlflow 3 refuses the file store unless
    MLFLOW_ALLOW_FILE_STORE is true, so it is set here when the user has not set it."""

    def __init__(self, mlflow: Any, output_dir: Path, config: dict, project: str, run_name: str):
        from mlflow.entities import Metric, Param

        self._metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (output_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.tracking_uri = uri
        self._client = mlflow.tracking.MlflowClient(uri)
        experiment = self._client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(project)
        self.run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [Param(key, str(value)[:_MLFLOW_PARAM_CHARS]) for key, value in flatten(config)]
        for chunk in _chunks(params, _MLFLOW_PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=chunk)

    def log(self, step: int, metrics: dict) -> None:
        now_ms = int(time.time() * 1000)
        entries = [self._metric(mlflow_name(key), value, now_ms, step) for key, value in scalars(metrics).items()]
        for chunk in _chunks(entries, _MLFLOW_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=chunk)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)
