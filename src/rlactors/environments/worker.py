"""One process per episode: an environment runs apart from the rollout engine.

A user's environment can raise, hang, leak memory or crash its interpreter; none of that may touch
the engine or the other episodes. So each episode's environment lives in its own process, forked
from a small fork server: a fresh single-threaded interpreter, started once per engine process,
that has imported only this package (not vLLM, not torch) and each environment's module (once,
at its first episode), so a fork costs a millisecond, not an interpreter start, and never copies
the engine's threads. The engine hands the server one end of
a socket pair per episode; the forked child talks over it, awaited on the engine's event loop, so
thousands of episodes wait at once without a thread each.

Every call has a time limit (`step_timeout_s`). Past it, or when the process dies, the episode's
process group is killed (the environment's own subprocesses with it) and the call raises
`EnvironmentFailure` naming what it waited for; the caller fails that sample alone.

Lifetimes: the server exits when the engine's end of its socket closes and gets SIGKILL if the
engine dies (PR_SET_PDEATHSIG); each episode process leads its own session and gets SIGKILL when
the server dies. No environment outlives its engine.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import traceback
from multiprocessing.connection import Connection

from rlactors.environments.protocol import StepResult, Turn

MAX_ERROR_CHARS = 2000
SERVER_START_TIMEOUT_S = 60.0
_server: _ForkServer | None = None


class EnvironmentFailure(RuntimeError):
    """The environment raised, timed out or died; the message says which and where."""


def _describe(error: BaseException) -> str:
    lines = traceback.format_exception(type(error), error, error.__traceback__)
    return "".join(lines[-6:])[-MAX_ERROR_CHARS:].strip()


class _ForkServer:
    """The engine's side of the fork server."""

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        code = "import sys; from rlactors.environments.worker import serve; serve(int(sys.argv[1]), int(sys.argv[2]))"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen([sys.executable, "-c", code, str(theirs.fileno()), str(os.getpid())],
                                        pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        ours.settimeout(SERVER_START_TIMEOUT_S)
        try:
            if ours.recv(5) != b"ready":
                raise EOFError
        except (TimeoutError, EOFError, OSError):
            self.process.kill()
            raise RuntimeError(f"the environment fork server did not start within {SERVER_START_TIMEOUT_S} s "
                               f"(exit code {self.process.poll()})") from None
        ours.setblocking(False)
        self.socket = ours
        self._locks: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}  # one per event loop using the server

    async def fork(self, arguments: list) -> tuple[int, Connection]:
        """A new episode process running `episode_main(*arguments)`: its pid and its connection.
        Forks are serialised (the server answers each in order) but never block the event loop."""
        async with self._locks.setdefault(asyncio.get_running_loop(), asyncio.Lock()):
            engine_end, episode_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            line = json.dumps(arguments).encode() + b"\n"

            async def exchange() -> bytes:
                with episode_end:
                    # The socket goes with the first bytes; a long line's rest follows as the server reads.
                    sent = await _send_with_fd(self.socket, line, episode_end.fileno())
                await asyncio.get_running_loop().sock_sendall(self.socket, line[sent:])
                return await _receive_line(self.socket)

            try:  # sending waits on the server reading too: one bound covers both ways
                line = await asyncio.wait_for(exchange(), SERVER_START_TIMEOUT_S)
            except TimeoutError:
                raise RuntimeError(f"the environment fork server did not fork within {SERVER_START_TIMEOUT_S} s") from None
            if not line:
                raise RuntimeError(f"the environment fork server exited (exit code {self.process.poll()})")
            return int(line), Connection(engine_end.detach())


def serve(fd: int, engine_pid: int) -> None:
    """The fork server's loop: one JSON line of episode arguments and one socket per fork."""
    import ctypes  # noqa: F401 - request_parent_death_signal's, imported once here, inherited by every fork

    from rlactors.environments import load_environment
    from rlactors.runtime.parent_death import request_parent_death_signal

    request_parent_death_signal(signal.SIGKILL)
    if os.getppid() != engine_pid:
        return
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    server = socket.socket(fileno=fd)
    server.sendall(b"ready")
    buffer, episode_fds, imported = b"", [], set()
    while True:
        # A long line arrives in pieces, its socket with the first: both are kept until it is whole.
        message, fds, _, _ = socket.recv_fds(server, 65536, 1)
        if not message:
            return  # the engine closed its end (or died)
        buffer += message
        episode_fds += fds
        while b"\n" in buffer and episode_fds:
            line, buffer = buffer.split(b"\n", 1)
            episode_fd = episode_fds.pop(0)
            arguments = json.loads(line)
            if arguments[0] not in imported:  # imported once here, so every fork has it already
                imported.add(arguments[0])
                try:
                    load_environment(arguments[0])
                except Exception:  # noqa: BLE001 - the episode process reports it, naming the spec
                    pass
            pid = os.fork()
            if pid == 0:
                server.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                try:
                    episode_main(Connection(episode_fd), *arguments)
                finally:
                    os._exit(0)
            os.close(episode_fd)
            server.sendall(f"{pid}\n".encode())


def episode_main(connection: Connection, spec: str, data_source: str, ground_truth, extra_info: dict) -> None:
    """The episode process: build the environment, then answer "reset" and "step" messages with
    ("ok", value) or ("error", description) until the pipe closes."""
    from rlactors.environments import load_environment
    from rlactors.runtime.parent_death import request_parent_death_signal

    os.setsid()  # its own process group: a kill takes the environment's subprocesses too
    request_parent_death_signal(signal.SIGKILL)
    try:
        factory = load_environment(spec)
        environment = factory(data_source=data_source, ground_truth=copy.deepcopy(ground_truth),
                              extra_info=copy.deepcopy(extra_info))
    except BaseException as error:  # noqa: BLE001 - reported to the engine, the episode fails
        connection.send(("error", f"building it: {_describe(error)}"))
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

    def __init__(self, spec: str, pid: int, connection: Connection, timeout_s: float):
        self.spec, self.pid, self.connection, self.timeout_s = spec, pid, connection, timeout_s

    @classmethod
    async def start(cls, spec: str, data_source: str, ground_truth, extra_info: dict,
                    timeout_s: float) -> EpisodeWorker:
        """Fork the episode's process (the fork server starts with the first episode)."""
        global _server
        if _server is None or _server.process.poll() is not None:
            _server = _ForkServer()
        pid, connection = await _server.fork([spec, data_source, ground_truth, extra_info])
        return cls(spec, pid, connection, timeout_s)

    async def reset(self) -> str:
        return await self._call("reset", None)

    async def step(self, turn: Turn) -> StepResult:
        return await self._call("step", turn)

    async def _call(self, kind: str, payload):
        what = f"environment {self.spec!r} {kind}()"
        try:
            try:
                self.connection.send((kind, payload))
            except OSError:
                pass  # the process has ended: what it said before (its build error) is still to be read
            status, value = await asyncio.wait_for(_receive(self.connection), self.timeout_s)
        except TimeoutError:
            self.close()
            raise EnvironmentFailure(f"{what} took longer than step_timeout_s={self.timeout_s}: "
                                     "its process was killed") from None
        except (EOFError, OSError):
            raise EnvironmentFailure(f"{what}: its process died") from None
        if status == "error":
            raise EnvironmentFailure(f"environment {self.spec!r} failed: {value}")
        return value

    def close(self) -> None:
        """Kill the episode's process group (idempotent)."""
        self.connection.close()
        for kill in (os.killpg, os.kill):  # the group, or the process if it had not led one yet
            try:
                kill(self.pid, signal.SIGKILL)
                break
            except (ProcessLookupError, PermissionError):
                continue


async def _send_with_fd(sock: socket.socket, data: bytes, fd: int) -> int:
    """Send the start of `data` with `fd` attached on a non-blocking socket; the bytes sent."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            return socket.send_fds(sock, [data], [fd])
        except BlockingIOError:  # the server has not read the previous line yet
            writable = loop.create_future()
            loop.add_writer(sock.fileno(), lambda ready=writable: ready.done() or ready.set_result(None))
            try:
                await writable
            finally:
                loop.remove_writer(sock.fileno())


async def _receive_line(sock: socket.socket) -> bytes:
    """One line from a non-blocking socket, read on the event loop (a pid is a few bytes: no buffering)."""
    loop = asyncio.get_running_loop()
    line = b""
    while not line.endswith(b"\n"):
        chunk = await loop.sock_recv(sock, 1)
        if not chunk:
            return b""
        line += chunk
    return line


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
