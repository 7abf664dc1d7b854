"""The tool of benchmarks/multiturn_overlap.py: answers each turn after `delay_s`, ends the
episode after 2 to `max_turns` turns, drawn per episode. Its own module, so an episode process imports nothing else."""

from __future__ import annotations

import random
import time

from rlactors.environments.protocol import StepResult


class SleepingTool:
    def __init__(self, data_source, ground_truth, extra_info):
        self.delay_s = float(extra_info["delay_s"])
        # Episodes of one prompt differ in length as real ones do (fresh entropy per episode process),
        # so samples drift out of step and one's tool wait can be filled with another's turn.
        self.num_turns = random.randint(2, int(extra_info["max_turns"]))

    def reset(self) -> str:
        return ""

    def step(self, turn) -> StepResult:
        time.sleep(self.delay_s)
        return StepResult(observation="=42;", reward=0.0, done=turn.turn_index + 1 >= self.num_turns)
