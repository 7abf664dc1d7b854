"""Environments for the episode tests, loaded by file path (`scripted_environments.py:Name`)."""

from __future__ import annotations

import os
import signal
import time

from rlactors.environments.protocol import StepResult, Turn


class Scripted:
    """Observation `#<turn>|` after each turn, reward 0.5 per turn, done after `num_turns`;
    `delay_s` per step stands in for a slow tool."""

    def __init__(self, data_source, ground_truth, extra_info):
        self.num_turns = int(extra_info.get("num_turns", 3))
        self.delay_s = float(extra_info.get("delay_s", 0.0))
        self.intro = extra_info.get("intro", "")

    def reset(self) -> str:
        return self.intro

    def step(self, turn: Turn) -> StepResult:
        time.sleep(self.delay_s)
        return StepResult(observation=f"#{turn.turn_index}|", reward=0.5, done=turn.turn_index + 1 >= self.num_turns)


class Raises(Scripted):
    def step(self, turn: Turn) -> StepResult:
        if turn.turn_index == 1:
            raise KeyError("scripted failure")
        return super().step(turn)


class Hangs(Scripted):
    def step(self, turn: Turn) -> StepResult:
        if turn.turn_index == 1:
            time.sleep(3600)
        return super().step(turn)


class Crashes(Scripted):
    def step(self, turn: Turn) -> StepResult:
        if turn.turn_index == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step(turn)


class FailsToReset(Scripted):
    def reset(self) -> str:
        raise RuntimeError("no episode today")
