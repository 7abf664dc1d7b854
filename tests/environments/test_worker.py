"""Episode processes (no engine): built per episode, answers in order, time limits, crashes and
the environment's own children killed with it."""

import asyncio
import os
import time
from pathlib import Path

import psutil
import pytest

from rlactors.environments.protocol import Turn
from rlactors.environments.worker import EnvironmentFailure, EpisodeWorker

SCRIPTED = Path(__file__).parents[1] / "rollout" / "scripted_environments.py"


def run(coroutine):
    return asyncio.run(coroutine)


def turn(index: int) -> Turn:
    return Turn("text", [], index, "stop")


def test_episodes_get_their_own_processes_and_answers():
    async def main():
        workers = await asyncio.gather(*(EpisodeWorker.start(f"{SCRIPTED}:Scripted", "d", "g",
                                                             {"num_turns": 2, "intro": f"i{n}"}, 10.0)
                                         for n in range(8)))
        try:
            assert len({w.pid for w in workers}) == 8 and os.getpid() not in {w.pid for w in workers}
            assert await asyncio.gather(*(w.reset() for w in workers)) == [f"i{n}" for n in range(8)]
            first = await workers[0].step(turn(0))
            second = await workers[0].step(turn(1))
            assert (first.observation, first.done, second.done) == ("#0|", False, True)
        finally:
            for worker in workers:
                worker.close()
        return [w.pid for w in workers]

    pids = run(main())
    time.sleep(0.5)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)


@pytest.mark.parametrize("name,expected", [
    ("Raises", "KeyError: 'scripted failure'"),
    ("Hangs", "took longer than step_timeout_s=1.0: its process was killed"),
    ("Crashes", "its process died"),
])
def test_a_failing_step_raises_naming_the_environment_and_cause(name, expected):
    async def main():
        worker = await EpisodeWorker.start(f"{SCRIPTED}:{name}", "d", "g", {}, 1.0)
        try:
            await worker.step(turn(0))
            with pytest.raises(EnvironmentFailure) as failure:
                await worker.step(turn(1))
            assert expected in str(failure.value) and f"{name}" in str(failure.value)
        finally:
            worker.close()

    run(main())


def test_an_environment_that_does_not_build_fails_its_first_call(tmp_path):
    (tmp_path / "bad.py").write_text("class Env:\n    def __init__(self, **kwargs):\n        raise ValueError('no')\n")

    async def main(wait_for_its_end: bool):
        worker = await EpisodeWorker.start(f"{tmp_path}/bad.py:Env", "d", "g", {}, 5.0)
        if wait_for_its_end:  # the process reported and exited before the first call: its pipe is closed
            deadline = time.monotonic() + 10
            while _running(worker.pid) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        with pytest.raises(EnvironmentFailure, match="(?s)bad.py:Env.* failed: building it: .*ValueError: no"):
            await worker.reset()
        worker.close()

    run(main(wait_for_its_end=False))
    run(main(wait_for_its_end=True))


def _running(pid: int) -> bool:
    """Whether `pid` is alive (a zombie, exited but not reaped by its parent, is not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_closing_an_episode_kills_the_processes_its_environment_started(tmp_path):
    (tmp_path / "spawner.py").write_text(
        "import subprocess, sys\n"
        "from rlactors.environments.protocol import StepResult\n"
        "class Env:\n"
        "    def __init__(self, **kwargs):\n"
        "        self.child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "    def reset(self):\n"
        "        return str(self.child.pid)\n"
        "    def step(self, turn):\n"
        "        return StepResult()\n")

    async def main():
        worker = await EpisodeWorker.start(f"{tmp_path}/spawner.py:Env", "d", "g", {}, 10.0)
        child = int(await worker.reset())
        assert psutil.pid_exists(child)
        worker.close()
        return child

    child = run(main())
    for _ in range(50):
        if not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the environment's child {child} outlived its episode")


def test_a_row_larger_than_one_socket_read_reaches_its_own_episode():
    async def main():
        big = {"num_turns": 2, "intro": "x" * 300_000}
        workers = await asyncio.gather(*(EpisodeWorker.start(f"{SCRIPTED}:Scripted", "d", "g", info, 10.0)
                                         for info in (big, {"intro": "small"}, big)))
        try:
            return await asyncio.gather(*(w.reset() for w in workers))
        finally:
            for worker in workers:
                worker.close()

    assert run(main()) == ["x" * 300_000, "small", "x" * 300_000]
