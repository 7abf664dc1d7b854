"""The command line: an error the product names is one line and an exit status, any other keeps
its traceback."""

from pathlib import Path

import pytest
import ray

from rlactors import cli
from rlactors.data import DataError
from rlactors.reward.failures import ScoringFailedError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run_raising(monkeypatch, error: BaseException):
    import rlactors.pipelines

    def run_pipeline(config, *args, **kwargs):
        raise error

    monkeypatch.setattr(rlactors.pipelines, "run_pipeline", run_pipeline)
    return cli.main(["run", str(EXAMPLES / "quickstart_cpu.yaml")])


@pytest.mark.parametrize(("error", "status", "line"), [
    (DataError("train.parquet row 3: field 'prompt' is missing"), 2, "error: train.parquet row 3: field 'prompt' is missing"),
    (ScoringFailedError("every sample failed for 3 steps: ZeroDivisionError"), 1,
     "error: ScoringFailedError: every sample failed for 3 steps: ZeroDivisionError"),
    (ray.exceptions.RayTaskError("sample", "Traceback (most recent call last):\n  File x\nValueError: bad", TimeoutError("stuck"),
                                 proctitle="ray::ReplayBuffer", pid=1, ip="x").as_instanceof_cause(), 1,
     "error: TimeoutError: stuck"),
])
def test_a_named_error_is_one_line_and_an_exit_status(monkeypatch, capsys, error, status, line):
    assert _run_raising(monkeypatch, error) == status
    err = capsys.readouterr().err
    assert err.strip() == line and "Traceback" not in err


def test_a_missing_config_file_is_one_line(capsys, tmp_path):
    assert cli.main(["run", str(tmp_path / "nowhere.yaml")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nowhere.yaml'}: no such config file"


def test_any_other_error_keeps_its_traceback(monkeypatch):
    with pytest.raises(AttributeError, match="a bug"):
        _run_raising(monkeypatch, AttributeError("a bug"))
