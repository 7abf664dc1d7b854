"""What a user sees of a run: a JSONL metrics file always, TensorBoard, wandb and mlflow as
`pipeline.loggers` names them (`rlactors.metrics.trackers`), a progress bar and one line per validation on the
terminal, and a PNG of the key curves (`plot_metrics`, also `python -m rlactors plot`).

Metric names follow veRL's: `reward/mean`, `val/<data_source>/acc`, `actor/ppo_kl`, `timing_s/step`, ...
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from rlactors.config import DEFAULT_LOGGERS
from rlactors.metrics.trackers import close_all, open_trackers

PLOTTED = [
    ("reward/mean", "training reward"),
    ("val/*/acc", "validation accuracy"),
    ("actor/ppo_kl", "KL (rollout/old vs new policy)"),
    ("response_length/mean", "response length (tokens)"),
    ("timing_s/step", "step time (s)"),
]
PROGRESS_KEYS = ["reward/mean", "val/*/acc", "actor/ppo_kl", "timing_s/step"]


def read_metrics(path: str | Path) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _matching(record: dict, pattern: str) -> dict[str, float]:
    if "*" not in pattern:
        return {pattern: record[pattern]} if pattern in record else {}
    head, tail = pattern.split("*")
    return {k: v for k, v in record.items() if k.startswith(head) and k.endswith(tail)}


class MetricsLogger:
    """Fans each step's metrics out to the trackers in `loggers` under the same names. jsonl writes
    one JSON object per step to `metrics.jsonl` (the step under key "step"); a resumed run appends
    to it, a fresh one starts it anew. `config` (a plain dict of the resolved config) is logged once
    to each tracker at start; `run_name` defaults to the folder name of `output_dir`."""

    def __init__(self, output_dir: str | Path, total_steps: int | None = None, progress: bool = True,
                 append: bool = False, loggers: Sequence[str] = DEFAULT_LOGGERS, config: dict | None = None,
                 project: str = "rlactors", run_name: str | None = None):
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / "metrics.jsonl"
        self.trackers = open_trackers(loggers, self.output_dir, append=append, config=config or {},
                                      project=project, run_name=run_name or self.output_dir.resolve().name)
        self._bar = None
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, desc="steps", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {k: _plain(v) for k, v in metrics.items()}
        for tracker in self.trackers:
            tracker.log(step, record)
        validation = {k: v for k, v in record.items() if k.startswith("val/") and isinstance(v, int | float)}
        if validation:
            self.write(f"step {step}: " + ", ".join(f"{k} {v:.3g}" for k, v in sorted(validation.items())))
        if self._bar is not None:
            shown = {}
            for pattern in PROGRESS_KEYS:
                for key, value in _matching(record, pattern).items():
                    shown[key.split("/")[-2] if key.startswith("val/") else key.split("/")[-1]] = f"{value:.3g}"
            self._bar.set_postfix(shown, refresh=False)
            self._bar.n = step
            self._bar.refresh()

    def write(self, line: str) -> None:
        """One line on the terminal above the progress bar (the bar stays at the bottom)."""
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        close_all(self.trackers)


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    return value


def plot_metrics(metrics_path: str | Path, png_path: str | Path | None = None) -> Path:
    """Draw reward, accuracy, KL, response length and step time over steps into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    png_path = Path(png_path or Path(metrics_path).with_suffix(".png"))
    figure, axes = plt.subplots(1, len(PLOTTED), figsize=(4 * len(PLOTTED), 3.2))
    for axis, (pattern, title) in zip(axes, PLOTTED, strict=True):
        series: dict[str, list[tuple[int, float]]] = {}
        for record in records:
            for key, value in _matching(record, pattern).items():
                if isinstance(value, int | float) and math.isfinite(value):
                    series.setdefault(key, []).append((record["step"], value))
        for key, points in sorted(series.items()):
            steps, values = zip(*points, strict=True)
            axis.plot(steps, values, marker="." if len(points) < 30 else None, label=key)
        if len(series) > 1 or "*" in pattern:
            axis.legend(fontsize=7)
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(png_path, dpi=100)
    plt.close(figure)
    return png_path
