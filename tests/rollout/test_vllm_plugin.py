"""The vLLM plugin of rollout engines (`rlactors.rollout.vllm_plugin`), in plain subprocesses: tying
a process to its parent, and recording vLLM's errors. (With real vLLM: tests/chaos/test_engine_process.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from rlactors.rollout.engine_core import start_failure_cause
from rlactors.rollout.vllm_plugin import ERROR_FILE_ENV, PARENT_PID_ENV, read_errors

# A process as vLLM starts one: the plugin runs first, then it lives on (prints its pid when tied).
CHILD = textwrap.dedent("""
    import os, sys, time
    from rlactors.rollout.vllm_plugin import in_vllm_process
    in_vllm_process()
    print(os.getpid(), os.environ.get("RLACTORS_ENGINE_PARENT_PID"), flush=True)
    time.sleep(600)
""")

# A parent as an engine actor is one: it names itself in the environment, starts the child, waits.
PARENT = textwrap.dedent(f"""
    import os, subprocess, sys, time
    os.environ["{PARENT_PID_ENV}"] = str(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], stdout=subprocess.PIPE, text=True)
    print(child.stdout.readline().split()[0], flush=True)
    time.sleep(600)
""")


def _gone_within(process: psutil.Process, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_process_started_for_an_engine_dies_when_its_parent_is_sigkilled():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        assert child.ppid() == parent.pid
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        assert _gone_within(child, timeout_s=30), f"pid {child.pid} outlived its SIGKILLed parent"
    finally:
        # Only this test's two processes: the suite's Ray (raylet, GCS) are children of pytest too.
        parent.kill()
        if child is not None and child.is_running():
            child.kill()


def test_a_process_whose_parent_died_before_the_plugin_ran_kills_itself():
    # The expected parent is not this process's parent: as if the parent died and the child was
    # re-parented before it could ask for the parent-death signal.
    env = {**os.environ, PARENT_PID_ENV: str(os.getpid() + 1_000_000)}
    child = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, (child.returncode, child.stderr)


@pytest.mark.parametrize("parent_pid", [None, "own"])
def test_the_plugin_leaves_other_processes_alone(parent_pid):
    """No engine actor started it (no variable), or it is the engine actor itself (its own pid)."""
    code = textwrap.dedent(f"""
        import ctypes, logging, os
        if {parent_pid!r} == "own":
            os.environ["{PARENT_PID_ENV}"] = str(os.getpid())
        os.environ["{ERROR_FILE_ENV}"] = "/nonexistent/errors.jsonl"
        from rlactors.rollout.vllm_plugin import in_vllm_process
        in_vllm_process()
        signal_number = ctypes.c_int(-1)
        ctypes.CDLL(None).prctl(2, ctypes.byref(signal_number), 0, 0, 0)  # PR_GET_PDEATHSIG
        print(len(logging.getLogger("vllm").handlers), signal_number.value)
    """)
    env = {key: value for key, value in os.environ.items() if key != PARENT_PID_ENV}
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["0", "0"]  # no error-recording handler, no parent-death signal


def test_vllm_errors_of_a_child_process_are_recorded_with_their_chain(tmp_path):
    error_file = tmp_path / "errors.jsonl"
    code = textwrap.dedent("""
        import logging
        from rlactors.rollout.vllm_plugin import in_vllm_process
        in_vllm_process()
        logger = logging.getLogger("vllm.model_executor.model_loader")
        try:
            try:
                raise OSError("weights.safetensors: header too large")
            except OSError as error:
                raise ValueError("could not load the weights") from error
        except ValueError:
            logger.exception("WorkerProc failed to start.")
        logger.warning("not an error: not recorded")
        logger.error("EngineCore failed to start.")
    """)
    env = {**os.environ, PARENT_PID_ENV: str(os.getpid()), ERROR_FILE_ENV: str(error_file)}
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    entries = read_errors(str(error_file))
    assert [entry["message"] for entry in entries] == ["WorkerProc failed to start.", "EngineCore failed to start."]
    assert entries[0]["errors"] == ["ValueError: could not load the weights", "OSError: weights.safetensors: header too large"]
    assert entries[1]["errors"] == []
    # The first record is the root cause of what the front end then sees.
    cause = start_failure_cause(RuntimeError("Engine core initialization failed. See root cause above."), str(error_file))
    assert cause.startswith("ValueError: could not load the weights, raised from OSError: weights.safetensors: header")
    assert f"pid {entries[0]['pid']}" in cause


def test_without_recorded_errors_the_front_end_error_is_the_cause(tmp_path):
    error = ValueError("max_model_len 100000 is greater than the model's 1024")
    assert start_failure_cause(error, str(tmp_path / "missing.jsonl")) == f"ValueError: {error}"
