"""examples/calculator_tool.py in its smoke mode (1 warm-up step, 1 GRPO step), as a user runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "calculator_tool.py"
# A Ray, a warm-up and a run of its own. In make test: the tool environments (tests/environments) and
# a multi-turn run with every built-in environment (tests/pipelines/test_multiturn.py).
pytestmark = [pytest.mark.vllm, pytest.mark.extended]
KEYS = {"accuracy_before", "accuracy_after", "tool_use_share_before", "tool_use_share_after", "steps", "seconds"}


@pytest.mark.timeout(300)
def test_calculator_tool_smoke(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--output", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert KEYS <= set(summary) and summary["steps"] == 1
    assert all(0.0 <= summary[key] <= 1.0 for key in KEYS - {"steps", "seconds"})
    assert (tmp_path / "warm_model" / "config.json").is_file()
    assert (Path(summary["final_model"]) / "config.json").is_file()
