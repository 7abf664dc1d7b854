"""Loading a user's object from a spec: `package.module:name` (importable) or `path/to/file.py:name`.

Shared by reward functions and environments, so both accept the same specs and fail the same way.
Standard library only: environment workers import it.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any


def load_object(spec: str, what: str, module_prefix: str = "_rlactors_user_") -> Callable[..., Any]:
    """The callable `name` of the spec's module. `what` ("reward function", "environment") starts
    every error message. A file is loaded as module `<module_prefix><file stem>`."""
    location, sep, name = spec.rpartition(":")
    if not sep or not location or not name.isidentifier():
        raise ValueError(f"{what} {spec!r}: expected 'module:{_noun(what)}' or 'path/to/file.py:{_noun(what)}'")
    if location.endswith(".py"):
        path = Path(location).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"{what} {spec!r}: no file {path}")
        module_spec = importlib.util.spec_from_file_location(f"{module_prefix}{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(location)
    value = getattr(module, name, None)
    if not callable(value):  # both users call what they load: a function, a class, a factory
        raise AttributeError(f"{what} {spec!r}: {location} has no callable {name!r}")
    return value


def _noun(what: str) -> str:
    # "reward function" -> "function", "environment" -> "Name": what the spec's last part names.
    return "function" if what.endswith("function") else "Name"
