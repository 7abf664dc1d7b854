"""PythonEnvironment: a "python" tool that runs the model's code and answers with its output.

The code is `code` (hermes) or `input` (plain: `[python print(sum(range(10)))]`; the plain format
ends a call at `]`, so such code cannot hold one: `list(...)` instead of `[...]`). Each call runs in
a fresh `sys.executable -I` (isolated: no PYTHONPATH, no user site) in an empty temporary folder,
in its own session, with
- `time_limit_s` (default 5 s) of wall clock, past which the whole process group is killed (so
  are the children it started), and a CPU-time limit of the same length behind it;
- `memory_limit_bytes` (default 512 MiB) of address space (`RLIMIT_AS`): a bigger allocation is a
  MemoryError in the code;
- `max_file_bytes` (default 16 MiB) per file written, stdout and stderr included (`RLIMIT_FSIZE`).
The observation is stdout, then the tail of stderr (where a traceback ends), truncated to
`max_output_chars` (default 1000), rendered `=<output>\\n` (see `rlactors.environments.common`).

A turn without a tool call is the final answer: done, reward 1.0 when its last number equals the
ground truth, else 0.0; tool turns get reward 0.0.

This is not a security boundary: the code runs as the worker's user, with its file system and
network. Run untrusted models' code only inside a container or VM that is one.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
from typing import Any

from rlactors.environments.common import answer_calls, answer_reward, environment_settings
from rlactors.environments.protocol import StepResult, Turn

TOOL_NAMES = ("python",)
TRUNCATED = "...(truncated)"


def _limits(time_limit_s: float, memory_limit_bytes: int, max_file_bytes: int):
    def apply() -> None:  # runs in the child between fork and exec
        cpu_s = max(1, int(time_limit_s) + 1)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    return apply


def _kill_group(process_group: int) -> None:
    try:
        os.killpg(process_group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the whole group has already exited
        pass


def _read_head(file, max_chars: int) -> str:
    file.seek(0)
    return file.read(max_chars * 4 + 1).decode("utf-8", errors="replace")  # utf-8: at most 4 bytes a char


def run_python(code: str, time_limit_s: float = 5.0, memory_limit_bytes: int = 512 * 2**20,
               max_file_bytes: int = 16 * 2**20, max_output_chars: int = 1000) -> str:
    """Run `code` in a fresh, limited interpreter; its output (stdout, then the tail of stderr),
    truncated to `max_output_chars`, or a line saying why there is none."""
    with tempfile.TemporaryDirectory(prefix="rlactors_python_") as folder, \
            tempfile.TemporaryFile(dir=folder) as stdout, tempfile.TemporaryFile(dir=folder) as stderr:
        # Files, not pipes: a pipe left open by a child the code started would keep a reader
        # waiting, and a file is read only as far as the bound.
        process = subprocess.Popen(
            [sys.executable, "-I", "-c", code], stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
            cwd=folder, start_new_session=True,
            preexec_fn=_limits(time_limit_s, memory_limit_bytes, max_file_bytes),
        )
        timed_out = False
        try:
            process.wait(timeout=time_limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(process.pid)  # also the children the code left behind (its session's group)
        process.wait()
        out, err = _read_head(stdout, max_output_chars), _tail(stderr, max_output_chars)
    if timed_out:
        err = (err + "\n" if err else "") + f"error: timed out after {time_limit_s:g} s"
    elif process.returncode < 0:
        err = (err + "\n" if err else "") + f"error: killed by signal {signal.Signals(-process.returncode).name}"
    return _bounded_output(out, err, max_output_chars)


def _tail(file, max_chars: int) -> str:
    size = file.seek(0, os.SEEK_END)
    file.seek(max(0, size - max_chars * 4))
    text = file.read().decode("utf-8", errors="replace").strip()
    return text if len(text) <= max_chars else TRUNCATED + text[-max_chars:]


def _bounded_output(out: str, err: str, max_chars: int) -> str:
    """stdout first; stderr's tail gets what room is left, at least a quarter of the bound."""
    if not err:
        return out if len(out) <= max_chars else out[:max_chars] + TRUNCATED
    err_room = max(max_chars // 4, max_chars - len(out))
    err = err if len(err) <= err_room else TRUNCATED + err[-err_room:]
    out_room = max_chars - len(err)
    out = out if len(out) <= out_room else out[:out_room] + TRUNCATED
    return out + ("" if not out or out.endswith("\n") else "\n") + err


class PythonEnvironment:
    def __init__(self, data_source: str = "", ground_truth: Any = None, extra_info: dict | None = None,
                 time_limit_s: float = 5.0, memory_limit_bytes: int = 512 * 2**20, max_file_bytes: int = 16 * 2**20,
                 max_output_chars: int = 1000, observation_prefix: str = "=", **ignored: Any) -> None:
        defaults = {"time_limit_s": time_limit_s, "memory_limit_bytes": memory_limit_bytes,
                    "max_file_bytes": max_file_bytes, "max_output_chars": max_output_chars,
                    "observation_prefix": observation_prefix}
        self.settings = environment_settings("python", defaults, extra_info)
        self.ground_truth = ground_truth

    def reset(self) -> str:
        return ""

    def step(self, turn: Turn) -> StepResult:
        if not turn.tool_calls:
            return StepResult(reward=answer_reward(turn.text, self.ground_truth), done=True)
        settings = dict(self.settings)
        prefix = settings.pop("observation_prefix")

        def run(call) -> str:
            code = call.arguments.get("code", call.arguments.get("input"))
            return run_python(code, **settings) if isinstance(code, str) else 'error: python takes a "code" string'

        return StepResult(observation=answer_calls(turn.tool_calls, TOOL_NAMES, run, prefix), reward=0.0)
