"""The reward worker subprocess: runs the scoring function for a `RewardScorer` actor.

The actor starts it with `start_new_session=True`, so the worker leads its own process group, and
every process a user function starts (a grandchild of the actor) is in that group unless it leaves
it on purpose. Killing the group stops them all. It is killed:
- by the actor, past a sample's time limit and on `close` (`stop_worker`);
- by itself, when the actor closes its pipe (an actor killed right after closing cannot kill it);
- by itself, when the actor dies (SIGKILL included): the kernel sends it SIGTERM
  (PR_SET_PDEATHSIG), and a thread watching its parent pid is the fallback where a signal handler
  cannot run (a long call in C holds the main thread); both kill the whole group;
- by `RewardPool.shutdown`, for a worker on the driver's node whose actor did not close in time;
- by the next incarnation of its actor, after Ray restarts it on the same node: the actor notes its
  worker's pid in the Ray session folder (`worker_record`), and a worker killed before it could
  kill its group (SIGKILL from outside) would otherwise leave the user function's children.

Each sample gets its own deep copy of `ground_truth` and `extra_info`: the samples of a group
share the request's objects, and a function that changes them must not change other samples.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from multiprocessing.connection import Connection, Pipe

from rlactors.reward.scoring import check_score, default_compute_score, load_user_function
from rlactors.runtime.parent_death import request_parent_death_signal
from rlactors.runtime.session import session_dir

WORKER_STARTUP_TIMEOUT_S = 120.0  # importing sympy and the user's module; generous on a busy machine
MAX_ERROR_CHARS = 2000


def _kill_own_group() -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)  # this process and every child left in its group


def _exit_when_orphaned(parent_pid: int) -> None:
    # If the actor dies the worker must not live on running user code, nor leave its children.
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    _kill_own_group()


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel for SIGTERM when the parent dies; the handler kills the group. The signal
    also comes when the parent *thread* that started this process ends, with the parent alive:
    the handler checks the parent pid first."""

    def on_parent_death(signum, frame) -> None:
        if os.getppid() != parent_pid:
            _kill_own_group()

    signal.signal(signal.SIGTERM, on_parent_death)
    request_parent_death_signal(signal.SIGTERM)  # where it cannot be had, the watching thread alone
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        _kill_own_group()


def _describe(error: BaseException) -> str:
    try:
        text = f"{type(error).__name__}: {error}"
    except Exception:  # a user exception whose __str__ raises
        text = type(error).__name__
    return text[:MAX_ERROR_CHARS]


def worker_main(fd: int, custom_function: str, gsm8k_mode: str, parent_pid: int) -> None:
    """Loop of the worker subprocess. Receives lists of (data_source, text, ground_truth,
    extra_info) and sends one (score, details, error) per item, in order, as each finishes."""
    connection = Connection(fd)
    _die_with_parent(parent_pid)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    try:
        if custom_function:
            compute_score = load_user_function(custom_function)
        else:
            compute_score = partial(default_compute_score, gsm8k_mode=gsm8k_mode)
    except BaseException as error:
        connection.send(("failed", _describe(error)))
        return
    connection.send(("ready", os.getpid()))
    while True:
        try:
            tasks = connection.recv()
        except EOFError:
            # The actor closed the pipe: the user function's children go with this worker. The actor
            # kills the group after closing, but it may itself be killed in between (a pool that
            # stops scorers which did not close in time), and then nothing else would.
            _kill_own_group()
        for data_source, text, ground_truth, extra_info in tasks:
            try:
                # Unpickled once per batch, the group's samples share these objects: copy per call.
                ground_truth, extra_info = copy.deepcopy(ground_truth), copy.deepcopy(extra_info)
                score, details = check_score(compute_score(data_source, text, ground_truth, extra_info))
                connection.send((score, details, None))
            except BaseException as error:  # SystemExit from user code included: only this sample fails
                connection.send((0.0, {}, _describe(error)))


def start_worker(custom_function: str | None, gsm8k_mode: str) -> tuple[subprocess.Popen, Connection]:
    ours, theirs = Pipe()
    # The command line names `rlactors.reward.scorer` (which re-exports worker_main): process
    # listings and tests find reward workers by it.
    code = "import sys; from rlactors.reward.scorer import worker_main; worker_main(*__import__('json').loads(sys.argv[1]))"
    arguments = json.dumps([theirs.fileno(), custom_function or "", gsm8k_mode, os.getpid()])
    # The child sees the modules the actor sees (a user function importable here imports there).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    process = subprocess.Popen(
        [sys.executable, "-c", code, arguments], pass_fds=(theirs.fileno(),), env=env, start_new_session=True
    )
    theirs.close()
    if not ours.poll(WORKER_STARTUP_TIMEOUT_S):
        stop_worker(process, ours)
        raise RuntimeError(f"reward worker did not start within {WORKER_STARTUP_TIMEOUT_S} s")
    try:
        status, detail = ours.recv()
    except EOFError:
        stop_worker(process, ours)
        raise RuntimeError(f"reward worker exited at startup (exit code {process.wait()})") from None
    if status != "ready":
        stop_worker(process, ours)
        raise RuntimeError(f"reward worker failed to start: {detail}")
    return process, ours


def stop_worker(process: subprocess.Popen, connection: Connection) -> None:
    kill_process_group(process.pid)  # before the pipe closes: a worker reading EOF ends the group itself
    connection.close()
    process.wait()


def worker_record() -> str | None:
    """The file where this scorer actor notes its worker's pid: one per actor id (which a restart
    keeps) in the node's Ray session folder; None outside a Ray actor."""
    import ray

    actor_id = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
    if actor_id is None:
        return None
    return os.path.join(session_dir(), "rlactors-reward-workers", actor_id)


def noted_worker(record: str | None) -> int | None:
    """The pid of the worker a scorer actor noted last in `record` (None: no note)."""
    if record is None:
        return None
    try:
        with open(record) as handle:
            return int(handle.read())
    except (FileNotFoundError, ValueError):
        return None


def stop_previous_worker(record: str | None) -> None:
    """Kill the process group of the worker an earlier incarnation of this actor noted."""
    pid = noted_worker(record)
    if pid is not None:
        kill_process_group(pid)


def note_worker(record: str | None, pid: int) -> None:
    if record is not None:
        os.makedirs(os.path.dirname(record), exist_ok=True)
        with open(record, "w") as handle:
            handle.write(str(pid))


def kill_process_group(pid: int) -> None:
    """SIGKILL to the group `pid` leads: the worker and the children the user function started."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
