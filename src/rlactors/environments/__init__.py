"""Environments for multi-turn, tool-using rollouts: the protocol (`protocol`), tool-call parsers
(`parsers`), and the built-in environments, loaded by name or by spec with `load_environment`.

Built-in (each constructed as `Cls(data_source=..., ground_truth=..., extra_info=...)`, settings
from `extra_info["environment_kwargs"]`, see `rlactors.environments.common`):
- "calculator": a `calc` tool evaluating arithmetic safely; the final answer is scored.
- "python": a `python` tool running code in a limited subprocess; the final answer is scored.
- "guess_number": guess the secret in a few turns, told higher or lower.

Standard library only, like the protocol: environment workers import this package.
"""

from __future__ import annotations

from collections.abc import Callable

from rlactors.environments.calculator import CalculatorEnvironment
from rlactors.environments.guess_number import GuessNumberEnvironment
from rlactors.environments.protocol import Environment, StepResult, ToolCall, Turn
from rlactors.environments.python_tool import PythonEnvironment

BUILTIN_ENVIRONMENTS: dict[str, type] = {
    "calculator": CalculatorEnvironment,
    "python": PythonEnvironment,
    "guess_number": GuessNumberEnvironment,
}


def load_environment(spec: str) -> Callable[..., Environment]:
    """The class (or factory) of a built-in name, a `path/to/module.py:Name` or a
    `package.module:Name`; a spec that does not load is a ValueError naming it."""
    if spec in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[spec]
    if ":" not in spec:
        raise ValueError(f"environment {spec!r}: not a built-in ({', '.join(sorted(BUILTIN_ENVIRONMENTS))}) "
                         "nor 'package.module:Name' nor 'path/to/module.py:Name'")
    from rlactors.runtime.user_code import load_object

    try:
        return load_object(spec, "environment", module_prefix="_rlactors_user_environment_")
    except ValueError:
        raise
    except Exception as error:  # noqa: BLE001 - user code fails in any way: name the spec
        message = str(error) if str(error).startswith(f"environment {spec!r}") else f"environment {spec!r}: {error}"
        raise ValueError(f"{message} ({type(error).__name__})") from error


__all__ = ["BUILTIN_ENVIRONMENTS", "CalculatorEnvironment", "Environment", "GuessNumberEnvironment",
           "PythonEnvironment", "StepResult", "ToolCall", "Turn", "load_environment"]
