"""What reaches the terminal and what only the log files get (`rlactors.runtime.logs`), each case in a
fresh interpreter: logging's state is per process, as it is in every process of a run."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tiny_runs import assert_prints_little_and_logs_everything, log_text

VLLM_PROCESS = """
import os
from rlactors.runtime import logs
logs.run_environment({log_dir!r}, verbose={verbose})
os.environ.update(logs.vllm_environment({config_dir!r}))
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging, init_logger
configure_logging(LoggingConfig())  # what vLLM's engine core and workers do at start, from the environment
log = init_logger("vllm.v1.worker.cpu_worker")
log.info("setting pause state to PAUSED_NEW")
log.warning("sleep mode is not supported on CPU, ignore it.")
log.warning("KV cache is nearly full")
log.error("engine core failed")
"""

RAY_WORKER = """
import logging, warnings
from rlactors.runtime import logs
logs.run_environment({log_dir!r}, verbose={verbose})
logs.configure_process()
logging.getLogger("some.library").info("loaded 12 shards")
logging.getLogger("rlactors.buffer").warning("prompt 7 dropped: too long")
import sysconfig
dependency = sysconfig.get_paths()["purelib"] + "/dependency/module.py"
warnings.warn_explicit("old API", FutureWarning, dependency, 3)
warnings.warn_explicit("check your data", UserWarning, dependency, 4)
warnings.warn_explicit("your reward's API changes", FutureWarning, "/home/user/reward.py", 5)
logging.getLogger("vllm.worker").error("sleep mode is not supported on CPU, and it failed")
"""


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          check=True)


def test_vllm_processes_keep_info_and_harmless_warnings_in_the_file(tmp_path):
    result = run_python(VLLM_PROCESS.format(log_dir=str(tmp_path / "logs"), config_dir=str(tmp_path), verbose=False))
    terminal = result.stdout + result.stderr
    assert "KV cache is nearly full" in terminal and "engine core failed" in terminal  # warnings and errors stay
    assert "setting pause state" not in terminal and "sleep mode is not supported" not in terminal
    [log_file] = (tmp_path / "logs").glob("vllm-*.log")
    logged = log_file.read_text()
    for message in ("setting pause state", "sleep mode is not supported", "KV cache is nearly full", "engine core failed"):
        assert message in logged
    assert "MainProcess pid=" in logged  # each line names its process


def test_verbose_vllm_processes_show_everything_and_still_log_it(tmp_path):
    result = run_python(VLLM_PROCESS.format(log_dir=str(tmp_path / "logs"), config_dir=str(tmp_path), verbose=True))
    terminal = result.stdout + result.stderr
    for message in ("setting pause state", "sleep mode is not supported", "KV cache is nearly full", "engine core failed"):
        assert message in terminal
    assert "setting pause state" in log_text(tmp_path / "logs")


def test_a_process_logs_in_full_to_its_file_and_keeps_warnings_on_the_terminal(tmp_path):
    result = run_python(RAY_WORKER.format(log_dir=str(tmp_path / "logs"), verbose=False))
    terminal = result.stdout + result.stderr
    assert "prompt 7 dropped: too long" in terminal and "check your data" in terminal
    assert "your reward's API changes" in terminal  # the user's own deprecations are theirs to see
    assert "and it failed" in terminal  # an error is never filtered, whatever it starts with
    assert "loaded 12 shards" not in terminal and "old API" not in terminal
    [log_file] = (tmp_path / "logs").glob("worker-*.log")  # outside an actor: named after host and pid
    logged = log_file.read_text()
    for message in ("loaded 12 shards", "prompt 7 dropped: too long", "FutureWarning: old API"):
        assert message in logged


def test_verbose_process_shows_dependency_warnings(tmp_path):
    result = run_python(RAY_WORKER.format(log_dir=str(tmp_path / "logs"), verbose=True))
    assert "old API" in result.stderr and "prompt 7 dropped: too long" in result.stderr


QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart_cpu.yaml"


@pytest.mark.vllm
@pytest.mark.extended  # the same through `ray job submit`: tests/cluster/test_job_submit.py
def test_a_run_prints_little_and_logs_everything(tmp_path, tiny_model_dir):
    """`python -m rlactors run` with its own local Ray."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("RLACTORS_")}
    overrides = [f"model.path={tiny_model_dir}", "model.dtype=auto", "data.num_train_rows=32", "data.num_val_rows=4",
                 "rollout.max_model_len=64", "rollout.sampling.max_response_tokens=4",
                 "rollout.sampling.num_samples_per_prompt=2", "rollout.validation_sampling.max_response_tokens=4",
                 "pipeline.num_steps=3", "pipeline.batch_size_prompts=2", "pipeline.val_every_steps=0",
                 "pipeline.resume=never", f"pipeline.output_dir={tmp_path}"]
    result = subprocess.run([sys.executable, "-m", "rlactors", "run", str(QUICKSTART), *overrides], env=env,
                            capture_output=True, text=True, timeout=600)
    terminal = result.stdout + result.stderr
    assert result.returncode == 0, terminal[-3000:]
    assert_prints_little_and_logs_everything(terminal, tmp_path, num_steps=3)
