import subprocess
import sys

from rlactors.metrics import MetricsLogger, plot_metrics, read_metrics


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
