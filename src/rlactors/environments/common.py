"""What the built-in environments share: their configuration, the final-answer check, and how a
tool's result is rendered.

Configuration: each built-in environment's settings are its constructor's keyword arguments (the
defaults), overridden per row by `extra_info["environment_kwargs"]`; a key the environment does not
know is a ValueError naming it (a misspelt setting would otherwise be silently ignored).

Observation rendering: a tool's result is `=<result>\\n` (`[calc 37*58]` is answered `=2146\\n`), the
same text for every tool and format. A character-level model without a chat template sees it
verbatim right after its `]`, so it reads as `[calc 37*58]=2146` and a new line starts the model's
next turn; a chat model gets the same text inside a tool message. `observation_prefix` replaces `=`.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_INTEGER = re.compile(r"-?\d+")


def environment_settings(name: str, defaults: dict[str, Any], extra_info: dict | None) -> dict[str, Any]:
    """`defaults` overridden by the row's `extra_info["environment_kwargs"]`."""
    overrides = (extra_info or {}).get("environment_kwargs") or {}
    if not isinstance(overrides, dict):
        raise ValueError(f"{name} environment: extra_info.environment_kwargs must be a dict, got {overrides!r}")
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ValueError(f"{name} environment: unknown environment_kwargs {unknown}; known: {sorted(defaults)}")
    return {**defaults, **overrides}


def last_number(text: str) -> Decimal | None:
    """The last number written in the text (`-12`, `3.5`), or None."""
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    try:
        return Decimal(numbers[-1])
    except InvalidOperation:
        return None


def last_integer(text: str) -> int | None:
    integers = _INTEGER.findall(text)
    # A guess has a few digits; a 10,000-digit "guess" is refused rather than parsed.
    return int(integers[-1]) if integers and len(integers[-1]) <= 100 else None


def answer_reward(text: str, ground_truth: Any) -> float:
    """1.0 when the turn's last number equals the ground truth numerically (2146 == 2146.0)."""
    try:
        gold = Decimal(str(ground_truth).strip())
    except InvalidOperation:
        raise ValueError(f"ground truth is not a number: {ground_truth!r}") from None
    answer = last_number(text)
    return float(answer is not None and answer == gold)


def render_result(result: str, prefix: str) -> str:
    return prefix + result + ("" if result.endswith("\n") else "\n")


def answer_calls(calls: list, tool_names: tuple[str, ...], run_tool, prefix: str) -> str:
    """One rendered result per call: `run_tool(call)`'s text for a call to one of `tool_names`, an
    error text for a malformed call or an unknown tool (the model reads it; nothing raises)."""
    results = []
    for call in calls:
        if call.error is not None:
            result = f"error: {call.error}"
        elif call.name not in tool_names:
            result = f"error: unknown tool {call.name!r}; tools: {', '.join(tool_names)}"
        else:
            result = run_tool(call)
        results.append(render_result(result, prefix))
    return "".join(results)
