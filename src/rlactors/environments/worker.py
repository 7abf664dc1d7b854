"""One process per episode: an environment runs apart from the rollout engine.

A user's environment can raise, hang, leak memory or crash its interpreter; none of that may touch
the engine or the other episodes. So each episode's environment lives in its own process, forked
from a small fork server (stdlib `multiprocessing` "forkserver": started once per engine process,
it has imported only this package, so a fork costs milliseconds, not an interpreter start). The
engine talks to it over a pipe, awaited on the event loop, so thousands of episodes wait at once
without a thread each.

Every call has a time limit (`step_timeout_s`). Past it, or when the process dies, the episode's
process group is killed (the environment's own subprocesses with it) and the call raises
`EnvironmentFailure` naming what it waited for; the caller fails that sample alone.

The episode process leads its own session and asks for SIGKILL when its parent (the fork server)
dies; the fork server exits when the engine process does, so no environment outlives its engine.
"""

from __future__ import annotations

import asyncio
import copy
import multiprocessing
import os
import signal
import traceback
from multiprocessing.connection import Connection

from rlactors.environments.protocol import StepResult, Turn

MAX_ERROR_CHARS = 2000
_context = None


class EnvironmentFailure(RuntimeError):
    """The environment raised, timed out or died; the message says which and where."""


def _fork_context():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        # Preloaded in the fork server, so each episode's fork starts with the built-in environments
        # imported (and not the engine's own modules: vLLM and torch stay out of it).
        _context.set_forkserver_preload(["rlactors.environments"])
    return _context


def _describe(error: BaseException) -> str:
    lines = traceback.format_exception(type(error), error, error.__traceback__)
    return "".join(lines[-6:])[-MAX_ERROR_CHARS:].strip()


def episode_main(connection: Connection, spec: str, data_source: str, ground_truth, extra_info: dict) -> None:
    """The episode process: build the environment, then answer "reset" and "step" messages with
    ("ok", value) or ("error", description) until the pipe closes."""
    from rlactors.environments import load_environment
    from rlactors.parent_death import request_parent_death_signal

    os.setsid()  # its own process group: a kill takes the environment's subprocesses too
    request_parent_death_signal(signal.SIGKILL)
    try:
        factory = load_environment(spec)
        environment = factory(data_source=data_source, ground_truth=copy.deepcopy(ground_truth),
                              extra_info=copy.deepcopy(extra_info))
    except BaseException as error:  # noqa: BLE001 - reported to the engine, the episode fails
        connection.send(("error", f"building environment {spec!r}: {_describe(error)}"))
        return
    while True:
        try:
            kind, payload = connection.recv()
        except EOFError:
            return
        try:
            if kind == "reset":
                value = environment.reset()
                if value is None:
                    value = ""
                if not isinstance(value, str):
                    raise TypeError(f"reset() returned {type(value).__name__}, expected str")
            else:
                value = environment.step(payload)
                if not isinstance(value, StepResult):
                    raise TypeError(f"step() returned {type(value).__name__}, expected StepResult")
                if not isinstance(value.observation, str):
                    raise TypeError(f"StepResult.observation is {type(value.observation).__name__}, expected str")
            connection.send(("ok", value))
        except BaseException as error:  # noqa: BLE001 - SystemExit from user code fails this episode only
            connection.send(("error", f"{kind}(): {_describe(error)}"))
            return


class EpisodeWorker:
    """The engine's handle on one episode's environment process."""

    def __init__(self, spec: str, data_source: str, ground_truth, extra_info: dict, timeout_s: float):
        self.spec = spec
        self.timeout_s = timeout_s
        ours, theirs = _fork_context().Pipe()
        self.connection = ours
        self.process = _fork_context().Process(
            target=episode_main, args=(theirs, spec, data_source, ground_truth, extra_info), daemon=True)
        self.process.start()
        theirs.close()

    async def reset(self) -> str:
        return await self._call("reset", None)

    async def step(self, turn: Turn) -> StepResult:
        return await self._call("step", turn)

    async def _call(self, kind: str, payload):
        what = f"environment {self.spec!r} {kind}()"
        try:
            self.connection.send((kind, payload))
        except (BrokenPipeError, OSError):
            raise EnvironmentFailure(f"{what}: its process had exited ({self._exit()})") from None
        try:
            status, value = await asyncio.wait_for(_receive(self.connection), self.timeout_s)
        except TimeoutError:
            self.close()
            raise EnvironmentFailure(f"{what} took longer than step_timeout_s={self.timeout_s}: "
                                     "its process was killed") from None
        except EOFError:
            raise EnvironmentFailure(f"{what}: its process died ({self._exit()})") from None
        if status == "error":
            raise EnvironmentFailure(f"environment {self.spec!r} failed: {value}")
        return value

    def _exit(self) -> str:
        self.process.join(timeout=5.0)
        code = self.process.exitcode
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def close(self) -> None:
        """Kill the episode's process group (idempotent)."""
        self.connection.close()
        if self.process.pid is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.process.kill()  # not yet its own group leader
        self.process.join(timeout=5.0)


async def _receive(connection: Connection):
    """The next message, awaited on the event loop (no thread waits on the pipe)."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    fd = connection.fileno()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)
    return connection.recv()  # EOFError when the process died
