"""GuessNumberEnvironment: a multi-turn game with no tools: guess the secret, told higher or lower.

The secret is the row's ground truth (an integer), in `low`..`high` (settings, defaults 1 and 16,
from `extra_info["environment_kwargs"]`; the prompt states the game, so `reset` returns "").
After each model turn the last integer in its text is the guess: a right guess ends the episode
with reward 1.0; otherwise the observation is `higher\\n` (the secret is above the guess) or
`lower\\n`, with reward 0.0, so an episode cut at the rollout's turn limit scores 0. A turn with no
integer is asked for one.
"""

from __future__ import annotations

from typing import Any

from rlactors.environments.common import environment_settings, last_integer
from rlactors.environments.protocol import StepResult, Turn

ASK_FOR_NUMBER = "say a number\n"


class GuessNumberEnvironment:
    def __init__(self, data_source: str = "", ground_truth: Any = None, extra_info: dict | None = None,
                 low: int = 1, high: int = 16, **ignored: Any) -> None:
        settings = environment_settings("guess_number", {"low": low, "high": high}, extra_info)
        self.low, self.high = int(settings["low"]), int(settings["high"])
        try:
            self.secret = int(str(ground_truth).strip())
        except ValueError:
            raise ValueError(f"guess_number environment: ground truth is not an integer: {ground_truth!r}") from None
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"guess_number environment: secret {self.secret} is outside {self.low}..{self.high}")

    def reset(self) -> str:
        return ""

    def step(self, turn: Turn) -> StepResult:
        guess = last_integer(turn.text)
        if guess is None:
            return StepResult(observation=ASK_FOR_NUMBER, reward=0.0)
        if guess == self.secret:
            return StepResult(reward=1.0, done=True)
        return StepResult(observation="higher\n" if self.secret > guess else "lower\n", reward=0.0)
