"""What a user sees of a run: `logger` writes each step's metrics (JSONL always) and fans them out to
the `trackers` (TensorBoard, wandb, mlflow); `evaluation` computes a validation or evaluation
pass's numbers (accuracy, pass@k) from scored responses."""

from rlactors.metrics.logger import (
    PLOTTED,
    PROGRESS_KEYS,
    MetricsLogger,
    plot_metrics,
    read_metrics,
)

__all__ = [
    "MetricsLogger",
    "PLOTTED",
    "PROGRESS_KEYS",
    "plot_metrics",
    "read_metrics",
]
