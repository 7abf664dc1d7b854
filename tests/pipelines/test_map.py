"""The map of one step at the top of `rlactors.pipelines` stays true: every file it names exists,
and every function or class it names is where it says."""

import importlib
import re
from pathlib import Path

import rlactors.pipelines

SOURCE = Path(rlactors.pipelines.__file__).resolve().parents[1]


def test_every_file_and_name_in_the_map_exists():
    doc = rlactors.pipelines.__doc__
    files = set(re.findall(r"\b([a-z_]+/[a-z_]+)(?=[.\s,)])", doc))
    assert len(files) > 10, files  # the pattern still finds the map's paths
    missing = sorted(name for name in files if not (SOURCE / f"{name}.py").is_file())
    assert not missing, f"the map names files that do not exist: {missing}"
    names = set(re.findall(r"\b([a-z_]+(?:/[a-z_]+)?)\.([A-Za-z_]+(?:\.[a-z_]+)?)\b", doc))
    modules = {path.stem for path in Path(rlactors.pipelines.__file__).parent.glob("*.py")}
    wrong = []
    for module, dotted in names:
        package = module.replace("/", ".") if "/" in module else f"pipelines.{module}" if module in modules else None
        if package is None:
            continue  # a class of a module named in full elsewhere in the line (BufferClient.sample)
        target = importlib.import_module(f"rlactors.{package}")
        for part in dotted.split("."):
            target = getattr(target, part, None)
        if target is None:
            wrong.append(f"{module}.{dotted}")
    assert not wrong, f"the map names what is not there: {wrong}"
