import importlib.util
import subprocess
import sys


def test_import_is_light():
    """`import rlactors` (and its config/data modules) must not pull in vLLM or start Ray."""
    code = (
        "import sys, rlactors, rlactors.config, rlactors.types, rlactors.data, rlactors.data.synthetic;"
        "import ray;"
        "print('vllm' in sys.modules, ray.is_initialized())"
    )
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.split() == ["False", "False"]


def test_forbidden_packages_absent_and_vllm_imports():
    for name in ("torchvision", "torchaudio", "torchcodec"):
        assert importlib.util.find_spec(name) is None, f"{name} must not be installed beside torch 2.13.0+cpu"
    code = "import vllm, transformers; from transformers import Qwen2ForCausalLM; print(vllm.__version__)"
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert output.returncode == 0, output.stderr[-2000:]


def test_cli_reports_config_errors_with_the_path():
    result = subprocess.run([sys.executable, "-m", "rlactors", "config", "trainer.optim.lrate=1"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "trainer.optim.lrate: unknown key" in result.stderr
