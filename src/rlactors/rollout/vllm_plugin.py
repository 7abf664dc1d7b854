"""Inside the processes vLLM starts for a rollout engine: tie each to its parent's life, keep its errors.

A rollout engine actor runs vLLM's front end (`AsyncLLM`); vLLM spawns an engine-core process
(`VLLM::EngineCore`) from it, which spawns the model worker(s) (`VLLM::Worker`). Two things nothing
else gives those processes:

Dying with their parent. A SIGKILL of the actor (or of an engine core) runs no clean-up, and an
orphaned engine core holds the model's memory for good. Recent Rays kill a dead worker's process
group from the raylet, but only while the raylet lives and the option is on (older Rays lack it);
vLLM's workers watch a pipe from the engine core, but the engine core watches nothing. So each
process asks the kernel to SIGKILL it when its parent dies (`prctl(PR_SET_PDEATHSIG)`, Linux). The
signal fires when the parent *thread* that spawned the process exits: the engine core is spawned
by the thread running the actor's asyncio loop, which Ray keeps for the actor's whole life, and
the workers by the engine core's main thread. A parent that died before the prctl is caught by
comparing `os.getppid()` with the parent pid the parent wrote into the environment.

Their errors. vLLM logs a failure in the engine core or a worker (a corrupt weights file, out of
memory) to that process's stderr, a Ray log file; the actor only gets "Engine core initialization
failed. See root cause above". Each process appends every ERROR record of vLLM's loggers, with its
exception chain, to a file the actor named (`ERROR_FILE_ENV`), one JSON object a line; the actor
reads it back (`read_errors`) to say why vLLM failed.

Why the workers are spawned, not forked, though each then imports vLLM and torch again (about 8 of
the 30 s a tiny CPU engine takes to start on 2 cores): vLLM binds a CPU worker's OpenMP threads to
its cores through OMP_PLACES, which the OpenMP runtime reads once, as it loads; a forked worker
keeps the engine core's runtime and with it the engine core's cores (measured).

vLLM calls its `vllm.general_plugins` entry points (pyproject.toml names `in_vllm_process`) in
every process it runs: the front end (`EngineArgs`), the engine core (`EngineCore.__init__`, before
its executor spawns the workers) and each worker (`WorkerWrapperBase.init_worker`, before the model
loads). Besides registering our weight-transfer backend (`rlactors`, inert until an engine is
started with it), the plugin acts only in processes an engine actor started (`PARENT_PID_ENV` set,
and not to this process's own pid), so other vLLM users of the same environment are unaffected.
This module imports only the standard library at import time: every vLLM process imports it.
"""

from __future__ import annotations

import json
import logging
import os
import signal

from rlactors.runtime.parent_death import request_parent_death_signal

PARENT_PID_ENV = "RLACTORS_ENGINE_PARENT_PID"  # pid of the process that starts this one
ERROR_FILE_ENV = "RLACTORS_ENGINE_ERROR_FILE"  # where vLLM's processes record their errors
MAX_ERROR_CHARS = 4000  # per record: a root cause, not a log
MAX_CHAINED_ERRORS = 5


def in_vllm_process() -> None:
    """vLLM general plugin: register our weight-transfer backend (every vLLM process); in a process an
    engine actor's vLLM started, also die with the parent and record vLLM's errors. vLLM runs it once
    per process (it may be imported more often)."""
    register_weight_transfer_backend()
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or int(parent) == os.getpid():
        return  # not started for a rollout engine, or the engine actor itself
    die_with_parent(int(parent))
    # This process's own children (the engine core's workers) check against this process.
    os.environ[PARENT_PID_ENV] = str(os.getpid())
    error_file = os.environ.get(ERROR_FILE_ENV)
    if error_file:
        record_errors(error_file)


def register_weight_transfer_backend() -> None:
    """Backend `rlactors` of vLLM's `WeightTransferEngineFactory` (shared memory or inline bytes,
    `rlactors.weight_sync.vllm_engine`), by module path: nothing is imported until an engine uses it."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if "rlactors" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            "rlactors", "rlactors.weight_sync.vllm_engine", "RlactorsWeightTransferEngine")


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies; if the parent is already gone
    (this process was re-parented before the call), die now."""
    why_not = request_parent_death_signal(signal.SIGKILL)
    if why_not is not None:
        logging.getLogger(__name__).warning("%s: this vLLM process may outlive its engine actor", why_not)
        return
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def record_errors(path: str) -> None:
    """Append vLLM's ERROR records of this process to `path` (see `read_errors`)."""
    vllm_logger = logging.getLogger("vllm")
    if not any(isinstance(h, ErrorFileHandler) for h in vllm_logger.handlers):
        vllm_logger.addHandler(ErrorFileHandler(path))


class ErrorFileHandler(logging.Handler):
    def __init__(self, path: str):
        super().__init__(level=logging.ERROR)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        try:
            entry = {"pid": os.getpid(), "process": process_title(), "message": record.getMessage()[:MAX_ERROR_CHARS],
                     "errors": describe_chain(record.exc_info[1] if record.exc_info else None)}
            # One write of one line in append mode: records of several processes never interleave.
            with open(self.path, "a", encoding="utf-8") as file:
                file.write(json.dumps(entry) + "\n")
        except Exception:  # noqa: BLE001 - a logging handler must never raise into vLLM
            self.handleError(record)


def describe_chain(error: BaseException | None) -> list[str]:
    """"Type: message" of an exception and of the ones it was raised from, outermost first."""
    described = []
    while error is not None and len(described) < MAX_CHAINED_ERRORS:
        described.append(f"{type(error).__name__}: {error}"[:MAX_ERROR_CHARS])
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return described


def process_title() -> str:
    """vLLM names its processes (`VLLM::EngineCore`, `VLLM::Worker`) through setproctitle."""
    try:
        import setproctitle

        return setproctitle.getproctitle().split()[0]
    except Exception:  # noqa: BLE001 - only a label
        return f"pid {os.getpid()}"


def read_errors(path: str | None) -> list[dict]:
    """The records `ErrorFileHandler` wrote to `path`, oldest first ([] if none or no file)."""
    if not path or not os.path.isfile(path):
        return []
    entries = []
    with open(path, encoding="utf-8") as file:
        for line in file:
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:  # a process killed mid-write: keep the text
                entries.append({"pid": None, "process": "?", "message": line.strip(), "errors": []})
    return entries
