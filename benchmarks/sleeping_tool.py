"""The tool of benchmarks/multiturn_overlap.py: answers each turn after `delay_s`, ends the
episode after `num_turns` turns. Its own module, so an episode process imports nothing else."""

from __future__ import annotations

import time

from rlactors.environments.protocol import StepResult


class SleepingTool:
    def __init__(self, data_source, ground_truth, extra_info):
        self.delay_s = float(extra_info["delay_s"])
        self.num_turns = int(extra_info["num_turns"])

    def reset(self) -> str:
        return ""

    def step(self, turn) -> StepResult:
        time.sleep(self.delay_s)
        return StepResult(observation="=42;", reward=0.0, done=turn.turn_index + 1 >= self.num_turns)
