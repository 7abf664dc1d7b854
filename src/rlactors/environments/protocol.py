"""The environment protocol: what a multi-turn rollout asks of a user's environment.

An environment is a class (or factory) named like a reward function, `path/to/module.py:Name` or
`package.module:Name`. It is constructed once per sample, in the sample's own worker process, from
the data row, with the reward function's arguments:

    environment = Name(data_source=..., ground_truth=..., extra_info=...)
    first = environment.reset()           # text shown before the model's first turn ("" for none)
    result = environment.step(turn)       # after each model turn: a StepResult

`extra_info` is the row's, whole (veRL rows keep tool arguments in `extra_info["tools_kwargs"]`
and interaction arguments in `extra_info["interaction_kwargs"]`); each sample gets its own copy.

`turn` is a `Turn`: the text of the model's turn and the tool calls the configured parser found in
it. `StepResult.observation` is appended to the sequence as observation tokens (trained with loss
mask 0); `reward` is an optional per-turn reward (the episode's reward is their sum); `done` ends
the episode. The rollout also ends it at its limits (`EnvironmentConfig`): `max_turns`, the
per-turn and total token budgets, and a per-step time limit (past which the worker is killed and
the sample fails with an error naming its prompt_id and turn).

Plain dataclasses and no imports beyond the standard library: environment workers and user code
import this module alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class ToolCall:
    """One tool call the parser found in a turn. `error` is set (and `name` may be empty) when the
    model wrote a call that does not parse: the environment decides what to answer."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class Turn:
    """The model's turn, as the environment sees it."""

    text: str
    tool_calls: list[ToolCall]
    turn_index: int  # 0 for the first model turn
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (the per-turn budget ran out)


@dataclass
class StepResult:
    observation: str = ""
    reward: float | None = None
    done: bool = False


class Environment(Protocol):
    def reset(self) -> str: ...

    def step(self, turn: Turn) -> StepResult: ...
