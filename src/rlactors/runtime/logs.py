"""What reaches the terminal, and where the rest of every process's log goes.

A run started by `init_ray(log_dir, verbose)` (every driver, the demo, `eval`) sets two variables
that every process of the run inherits (Ray's runtime env for its workers, the environment for
vLLM's own processes):

- `RLACTORS_LOG_DIR`: each process's full log lands in a file there (`output_dir/logs/`):
  `<Actor class>-<host>-<pid>.log` for a Ray actor's Python log records and the warnings kept
  off the terminal, `driver-<host>-<pid>.log` for the driver's, `vllm-<host>.log` for every vLLM process of that
  node (each line names its process and pid). What a process prints itself stays where Ray keeps
  it (its session's `logs/worker-*.out|err`) and, unless filtered below, on the terminal.
- `RLACTORS_VERBOSE`: unset or "0", the terminal gets vLLM, Ray and transformers at WARNING and
  above, less the known-harmless messages in `HARMLESS` and dependencies' deprecation warnings
  (in vLLM's own processes those are dropped at interpreter start: `PYTHONWARNINGS`); "1", it
  gets everything as before. Errors always reach the terminal.

Two lines per engine start still get through on CPU: vLLM's engine core and worker warn that Triton
has no CPU backend while they unpickle their config, before vLLM sets up their logging.

`configure_process` applies this in a process: Ray runs it in every worker of the run (the
runtime env's `worker_process_setup_hook`) and the driver calls it itself; `vllm_environment`
gives the engine actor the logging config its vLLM processes read at import.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import sysconfig
import warnings
from pathlib import Path

LOG_DIR_ENV = "RLACTORS_LOG_DIR"
VERBOSE_ENV = "RLACTORS_VERBOSE"
SETUP_HOOK = "rlactors.runtime.logs.configure_process"

# Messages known to be harmless where they appear; they still go to the log file. Each entry is
# the start of the message and why it is harmless.
HARMLESS = {
    "sleep mode is not supported on CPU": "a CPU engine keeps its memory; rlactors stops its process instead",
    "RotaryEmbedding: Failed to load weights": "the rotary cache has no weights to receive",
    "ParallelLMHead: Failed to load weights": "a tied head is re-tied after every sync (rlactors_refresh_tied_head)",
    "Model Runner V2 requires Triton": "vLLM falls back to its V1 runner on CPU",
    "Triton is not installed": "CPU engines run without Triton",
    "Triton is installed, but doesn't include CPU backend": "CPU trainers run without Triton",
    "libtcmalloc is not found in LD_PRELOAD": "a CPU allocator hint; the Docker image for GPUs does not need it",
    "libiomp is not found in LD_PRELOAD": "a CPU OpenMP hint; the Docker image for GPUs does not need it",
    "Enforce eager set, disabling torch.compile": "rollout.enforce_eager asked for it",
    "Inductor compilation was disabled by user settings": "follows from enforce_eager",
    "Token authentication is enabled for this Ray cluster": "a local Ray instance, this machine only",
    "This model does not officially support disabling chunked prefill": "rlactors prefills whole prompts on CPU "
    "(rlactors.rollout.vllm_args)",
    "Reset SSM cache type to float32": "the models here have no SSM layers",
}
# Deprecation warnings raised inside dependencies: the user cannot act on them.
QUIET_CATEGORIES = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def is_verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "0") == "1"


def set_up_driver(log_dir: str | Path | None, verbose: bool) -> dict[str, str]:
    """Before a run's first model load or Ray start, in its driver: the run's variables
    (`run_environment`), and this process's logging as every worker's will be."""
    env = run_environment(log_dir, verbose)
    configure_process("driver")
    return env


def link_ray_logs(log_dir: str | Path) -> None:
    """`log_dir/ray`: a link to this node's Ray session logs, where every worker's raw stdout and
    stderr are (`worker-*.out|err`) and Ray's own (`raylet.out`, ...). Other nodes keep theirs."""
    from rlactors.runtime.session import session_dir

    link = Path(log_dir) / "ray"
    try:
        if link.is_symlink():
            link.unlink()
        if not link.exists():
            link.symlink_to(Path(session_dir()) / "logs", target_is_directory=True)
    except OSError as error:  # a filesystem without links: the logs stay where Ray keeps them
        logging.getLogger(__name__).info("no link to Ray's session logs at %s: %s", link, error)


def run_environment(log_dir: str | Path | None, verbose: bool) -> dict[str, str]:
    """The variables every process of a run gets (and this one is given): where full logs go,
    whether the terminal gets everything, and no download progress bars from Hugging Face."""
    env = {VERBOSE_ENV: "1" if verbose else "0"}
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        env[LOG_DIR_ENV] = str(Path(log_dir).absolute())
    if not verbose:
        env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # transformers' "Loading weights" bars, per model load
    os.environ.update(env)
    return env


def is_harmless(message: str) -> bool:
    return message.startswith(tuple(HARMLESS))


class KnownHarmless(logging.Filter):
    """Drops the warnings (never errors) whose message starts like one in `HARMLESS`; on terminal
    handlers only, so the log files keep them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not is_harmless(record.getMessage())


def _log_file(name: str) -> logging.FileHandler:
    folder = Path(os.environ[LOG_DIR_ENV])
    folder.mkdir(parents=True, exist_ok=True)
    # Append: a restarted actor, or several processes of one node, add to the file (one write per line).
    return logging.FileHandler(folder / f"{name}.log", mode="a", encoding="utf-8", delay=True)


def vllm_file_handler() -> logging.Handler:
    """The handler vLLM's logging config names (`"()"`): one file per node for its processes."""
    return _log_file(f"vllm-{socket.gethostname()}")


def vllm_environment(config_folder: str | Path) -> dict[str, str]:
    """For the engine actor, before vLLM is imported: a vLLM logging config (written into
    `config_folder`, node-local) with the full log to `vllm-<host>.log` and the terminal at WARNING
    less `HARMLESS` (everything when verbose). Empty when the run has no log folder."""
    if LOG_DIR_ENV not in os.environ:
        return {}
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO")
    line = "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s"
    formatter = {"()": "vllm.logging_utils.NewLineFormatter", "format": line, "datefmt": "%m-%d %H:%M:%S",
                 "log_level": level}
    terminal = {"class": "logging.StreamHandler", "formatter": "vllm", "stream": "ext://sys.stdout",
                "level": level if is_verbose() else "WARNING", "filters": [] if is_verbose() else ["harmless"]}
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"vllm": formatter},
        "filters": {"harmless": {"()": "rlactors.runtime.logs.KnownHarmless"}},
        "handlers": {"terminal": terminal,
                     "file": {"()": "rlactors.runtime.logs.vllm_file_handler", "formatter": "vllm", "level": level}},
        "loggers": {"vllm": {"handlers": ["terminal", "file"], "level": level, "propagate": False}},
    }
    path = Path(config_folder) / f"vllm-logging-{os.getpid()}.json"  # one per engine actor: never rewritten under a reader
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=1))
    env = {"VLLM_LOGGING_CONFIG_PATH": str(path)}
    if not is_verbose():
        # vLLM's engine core and workers import half of torch before any logging or plugin of theirs
        # is set up: their dependencies' deprecation warnings can only be stopped at interpreter start.
        ours = [f"ignore::{category.__name__}" for category in QUIET_CATEGORIES]
        # The user's own filters come after ours, so that theirs win where both match.
        env["PYTHONWARNINGS"] = ",".join([*ours, *filter(None, [os.environ.get("PYTHONWARNINGS")])])
    return env


class ActorLogFile(logging.Handler):
    """A process's log file, opened at its first record and named after the actor the Ray worker
    then hosts (`TrainerWorker-<host>-<pid>.log`), else `name` (`worker-...` for a task's worker)."""

    def __init__(self, name: str = "worker", level: int = logging.INFO):
        super().__init__(level)
        self.name = name
        self._file: logging.FileHandler | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self._file is None:
            # The host too: several nodes (each with its own pids) write into one shared folder.
            self._file = _log_file(f"{_actor_class() or self.name}-{socket.gethostname()}-{os.getpid()}")
            self._file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self._file.emit(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        super().close()


def _actor_class() -> str | None:
    try:
        import ray

        if not ray.is_initialized():  # get_runtime_context() would start a Ray
            return None
        actor = ray.get_runtime_context().current_actor
        return actor._ray_actor_creation_function_descriptor.class_name
    except Exception:  # noqa: BLE001 - not in an actor (a task, the driver): no class to name
        return None


def configure_process(name: str = "worker") -> None:
    """In a process of the run (Ray worker, driver): Python log records at INFO and the warnings
    kept off the terminal go to this process's log file; the terminal keeps WARNING and above,
    less `HARMLESS` and dependencies' deprecation warnings unless verbose. Never raises: a worker
    must start regardless."""
    try:
        _configure(is_verbose(), name)
    except Exception as error:  # noqa: BLE001
        logging.getLogger(__name__).warning("logging set-up failed, keeping the defaults: %s", error)


def _configure(verbose: bool, name: str) -> None:
    root = logging.getLogger()
    log_file = next((h for h in root.handlers if isinstance(h, ActorLogFile)), None)
    if log_file is None and LOG_DIR_ENV in os.environ:
        shown_from = root.getEffectiveLevel()
        if not root.handlers:
            # What logging's last resort did before the file handler existed: warnings to stderr.
            root.addHandler(logging.StreamHandler())
        for handler in root.handlers:
            if handler.level == logging.NOTSET:
                # The root now passes INFO on to the file: each handler keeps showing what it did.
                handler.setLevel(shown_from)
        log_file = ActorLogFile(name)
        root.addHandler(log_file)
        root.setLevel(min(shown_from, logging.INFO))
    if verbose:
        return
    for logger_name in ("", "ray", "transformers"):
        for handler in logging.getLogger(logger_name).handlers:
            if not isinstance(handler, ActorLogFile | logging.FileHandler) and not any(
                    isinstance(f, KnownHarmless) for f in handler.filters):
                handler.addFilter(KnownHarmless())
    if "transformers" in sys.modules:
        # transformers reads HF_HUB_DISABLE_PROGRESS_BARS at import: a process that has it
        # already (the driver) is told directly.
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    _route_quiet_warnings(log_file)


def _route_quiet_warnings(log_file: logging.Handler | None) -> None:
    """Deprecation warnings raised inside installed dependencies, and harmless ones, go to the log
    file instead of the terminal; every other warning (the user's own code, rlactors) shows as
    before. Without a log file nothing is rerouted."""
    if log_file is None or getattr(warnings.showwarning, "_rlactors", False):
        return
    shown = warnings.showwarning
    file_only = logging.getLogger("rlactors.quiet_warnings")
    file_only.propagate = False
    file_only.addHandler(log_file)

    def showwarning(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if (issubclass(category, QUIET_CATEGORIES) and in_dependency(filename)) or is_harmless(text):
            file_only.warning("%s:%s: %s: %s", filename, lineno, category.__name__, text)
        else:
            shown(message, category, filename, lineno, file, line)

    showwarning._rlactors = True
    warnings.showwarning = showwarning


def in_dependency(filename: str) -> bool:
    """Whether `filename` is an installed package's (site-packages) other than rlactors."""
    path = os.path.abspath(filename)
    installed = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    return any(path.startswith(folder + os.sep) for folder in installed) and not path.startswith(_PACKAGE + os.sep)


_PACKAGE = os.path.dirname(os.path.abspath(__file__))
