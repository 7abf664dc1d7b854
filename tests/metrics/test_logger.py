import re
import subprocess
import sys

import pytest

from rlactors.config import load_config
from rlactors.metrics import MetricsLogger, plot_metrics, read_metrics
from rlactors.metrics.trackers import TrackerError
from rlactors.pipelines.preflight import PreflightError, check_config


def _log(directory, steps, append=False):
    logger = MetricsLogger(directory, total_steps=len(steps), progress=True, append=append)
    for step in steps:
        logger.log(step, {"reward/mean": 0.1 * step, "val/synthetic/arithmetic/acc": 0.5, "actor/ppo_kl": 1e-4,
                          "response_length/mean": 4.0, "timing_s/step": 1.0})
    logger.close()
    return logger.path


def test_fresh_runs_start_the_file_and_resumed_runs_append(tmp_path):
    path = _log(tmp_path, [0, 1, 2])
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]
    _log(tmp_path, [3], append=True)
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3]
    _log(tmp_path, [0])
    assert [r["step"] for r in read_metrics(path)] == [0]
    assert (tmp_path / "tensorboard").is_dir()


def test_plot_from_a_metrics_file(tmp_path):
    path = _log(tmp_path, [0, 1, 2])
    png = plot_metrics(path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = tmp_path / "other.png"
    result = subprocess.run([sys.executable, "-m", "rlactors", "plot", str(path), "-o", str(out)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 1000


def _offline(monkeypatch, tmp_path):
    """wandb offline and mlflow's local store, with wandb's per-user folders inside tmp_path."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "home" / name.lower()))
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the tracker sets it; undone after the test


def test_every_tracker_gets_the_same_names_steps_and_the_config(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _offline(monkeypatch, tmp_path)
    output_dir = tmp_path / "run"
    config = load_config(None, ["pipeline.loggers=[jsonl, tensorboard, wandb, mlflow]", f"pipeline.output_dir={output_dir}"])
    logger = MetricsLogger(output_dir, 3, progress=False, loggers=config.pipeline.loggers,
                           config=config.model_dump(mode="json"), project=config.pipeline.project)
    logged = {step: {"reward/mean": 0.25 * step, "val/synthetic/arithmetic/acc": 0.5 + 0.1 * step,
                     "val/synthetic/arithmetic/pass@2": 0.75, "actor/ppo_kl": float("nan"), "note": "text"}
              for step in range(3)}
    for step, metrics in logged.items():
        logger.log(step, metrics)
    logger.close()

    records = read_metrics(logger.path)  # jsonl keeps every value, the others only the finite numbers
    assert [(r["step"], r["reward/mean"], r["note"]) for r in records] == [(s, 0.25 * s, "text") for s in range(3)]

    events = EventAccumulator(str(output_dir / "tensorboard"))
    events.Reload()
    assert {"reward/mean", "val/synthetic/arithmetic/acc"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(s, 0.25 * s) for s in range(3)]
    assert "actor/ppo_kl" not in events.Tags()["scalars"]

    run_files = list((output_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1 and run_files[0].stat().st_size > 0
    # No Python reader of .wandb files ships with wandb 0.31 (its Go core reads them); history keys
    # are stored as plain strings inside the protobuf records, so a byte search finds the names.
    run_bytes = run_files[0].read_bytes()
    assert b"reward/mean" in run_bytes and b"val/synthetic/arithmetic/acc" in run_bytes
    assert b"trainer" in run_bytes and b"low_var_kl" in run_bytes  # the config

    (mlflow_tracker,) = [t for t in logger.trackers if type(t).__name__ == "MlflowTracker"]
    assert mlflow_tracker.tracking_uri == (output_dir / "mlruns").resolve().as_uri()
    client = MlflowClient(mlflow_tracker.tracking_uri)
    history = client.get_metric_history(mlflow_tracker.run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in history) == [(s, 0.25 * s) for s in range(3)]
    assert client.get_metric_history(mlflow_tracker.run_id, "actor/ppo_kl") == []
    # mlflow refuses "@" in a name: pass@k is pass_at_k there, and only there.
    assert [m.value for m in client.get_metric_history(mlflow_tracker.run_id, "val/synthetic/arithmetic/pass_at_2")] \
        == [0.75] * 3
    run = client.get_run(mlflow_tracker.run_id)
    assert (run.info.status, run.info.run_name) == ("FINISHED", "run")
    assert run.data.params["trainer.optim.lr"] == "0.0005"
    assert run.data.params["pipeline.loggers"] == "['jsonl', 'tensorboard', 'wandb', 'mlflow']"
    assert client.get_experiment(run.info.experiment_id).name == "rlactors"


@pytest.mark.parametrize("name, module", [("wandb", "wandb"), ("mlflow", "mlflow"),
                                          ("tensorboard", "torch.utils.tensorboard")])
def test_a_named_tracker_whose_package_is_missing_fails_at_start(tmp_path, monkeypatch, name, module):
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError, as if not installed
    install = "pip install 'rlactors[trackers]'" if name != "tensorboard" else "pip install tensorboard"
    loggers = ["jsonl", "wandb", "mlflow", "tensorboard"]
    with pytest.raises(TrackerError) as error:  # before any tracker starts (wandb would try to log in)
        MetricsLogger(tmp_path, progress=False, loggers=loggers)
    assert "pipeline.loggers" in str(error.value) and install in str(error.value) and repr(name) in str(error.value)
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "mlruns").exists()
    config = load_config(None, [f"pipeline.loggers=[{', '.join(loggers)}]"])
    with pytest.raises(PreflightError, match=r"pipeline\.loggers.*" + re.escape(install)):
        check_config(config, tmp_path)


def test_tensorboard_missing_is_skipped_only_in_the_default_list(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    logger = MetricsLogger(tmp_path, progress=False)
    logger.log(1, {"reward/mean": 1.0})
    logger.close()
    assert [type(t).__name__ for t in logger.trackers] == ["JsonlTracker"]
    assert not (tmp_path / "tensorboard").exists()
    with pytest.raises(TrackerError, match="must include 'jsonl'"):
        MetricsLogger(tmp_path, progress=False, loggers=["tensorboard"])


def test_online_wandb_without_a_key_is_refused_before_the_run(tmp_path, monkeypatch):
    from rlactors.metrics.trackers import check_installed

    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: never logged in
    monkeypatch.setenv("NETRC", str(tmp_path / ".netrc"))
    with pytest.raises(TrackerError, match="WANDB_MODE=offline"):
        check_installed(["jsonl", "wandb"])
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_installed(["jsonl", "wandb"])
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    (tmp_path / ".netrc").chmod(0o600)
    check_installed(["jsonl", "wandb"])
