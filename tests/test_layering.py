"""The packages of rlactors are floors: a package may import the ones below it, never one that
imports it back (directly or round a longer loop), lazy imports inside functions included."""

import ast
from collections import defaultdict
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "rlactors"


def package_imports() -> dict[str, dict[str, list[str]]]:
    """package -> {package it imports: [the files that do]}, over every import statement."""
    packages = {path.name for path in SOURCE.iterdir() if (path / "__init__.py").is_file()}
    imports: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in SOURCE.rglob("*.py"):
        parts = path.relative_to(SOURCE).parts
        if len(parts) < 2:
            continue  # a module of the package root
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                dotted = name.split(".")
                if dotted[0] == "rlactors" and len(dotted) > 1 and dotted[1] in packages and dotted[1] != parts[0]:
                    imports[parts[0]][dotted[1]].append(str(path.relative_to(SOURCE)))
    return imports


def test_no_package_imports_one_that_imports_it_back():
    imports = package_imports()
    loops = []

    def visit(package: str, path: list[str]) -> None:
        for imported in imports.get(package, {}):
            if imported == path[0]:
                loops.append(" -> ".join(path + [imported]) + f" (first: {sorted(set(imports[package][imported]))})")
            elif imported not in path:
                visit(imported, path + [imported])

    for package in sorted(imports):
        visit(package, [package])
    assert not loops, "imports running back up:\n" + "\n".join(loops)


def test_the_check_sees_a_real_import():
    # The trainer sends weights through weight_sync (a floor below it): the walk must find that.
    assert "weight_sync" in package_imports()["trainer"]


def test_the_package_root_holds_only_entry_points_and_types():
    # Everything else lives in a package a newcomer finds by name (config/, runtime/, data/, ...).
    modules = {path.stem for path in SOURCE.glob("*.py")}
    assert modules == {"__init__", "__main__", "cli", "demo", "types"}, sorted(modules)


def test_the_runtime_floor_imports_no_other_package():
    # Every package waits on actors, logs and writes files through runtime/: it must sit below them all.
    assert not package_imports().get("runtime"), dict(package_imports()["runtime"])
