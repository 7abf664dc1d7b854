"""`ray job submit` to a real Ray head: the quickstart config runs as a job, from the uploaded
working dir, and the head and everything it started are gone afterwards.

The head gets its own temp dir, ports and auth token (its dashboard on 127.0.0.1 only), so it
neither collides with nor stops any other Ray on the machine; it is stopped process by process,
never with `ray stop`, which stops every Ray of this user on the machine."""

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest
from tiny_runs import assert_prints_little_and_logs_everything

REPO_ROOT = Path(__file__).resolve().parents[2]
RAY_BIN = str(Path(sys.executable).parent / "ray")
# What `ray job submit` uploads: the repository without its environment, outputs and caches (the
# .gitignore already excludes them; stating them keeps a stray big folder from blocking the upload).
# py_modules puts the uploaded package first on the job's path, ahead of an installed rlactors.
RUNTIME_ENV = {"excludes": [".venv", "outputs", ".cache", ".git"], "py_modules": ["src/rlactors"]}
# The entrypoint runs in a shell on the head, with the head's PATH: naming this interpreter keeps the
# job off whichever `python` comes first there.
PYTHON = sys.executable
HEAD_START_TIMEOUT_S = 120
JOB_TIMEOUT_S = 600
STOP_TIMEOUT_S = 30
# SIGTERM ends the job's processes; the head's own (gcs_server, raylet, the monitor, the runtime-env
# agent, `ray start --block` itself) were still there after 30 s each time: what is left after this
# grace gets SIGKILL.
TERM_GRACE_S = 5
NUM_CPUS = 4


def free_ports(num_ports: int) -> list[int]:
    """Distinct free ports on 127.0.0.1 (all held open until every one is chosen)."""
    sockets = [socket.socket() for _ in range(num_ports)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def processes_referencing(path: str) -> list[psutil.Process]:
    """Live processes whose command line or working directory names `path`."""
    found = []
    for process in psutil.process_iter():
        try:
            cwd = process.cwd()
            if any(path in arg for arg in process.cmdline()) or cwd == path or cwd.startswith(path + os.sep):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def describe(processes: list[psutil.Process]) -> str:
    lines = []
    for process in processes:
        try:
            lines.append(f"{process.pid}: {' '.join(process.cmdline())[:200]}")
        except psutil.Error:
            lines.append(f"{process.pid}: (exited)")
    return "\n".join(lines)


class LocalHead:
    """`ray start --head --block` in a session of its own, in its own temp dir, on its own ports."""

    def __init__(self):
        # Short, under /tmp: Ray's unix sockets live under the temp dir, and a socket path may
        # not exceed 107 bytes.
        self.temp_dir = tempfile.mkdtemp(prefix="rlj", dir="/tmp")
        gcs_port, self.dashboard_port, client_port, agent_port = free_ports(4)
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        self.log_path = Path(self.temp_dir) / "head.log"
        # Ray turns token auth on when it finds a token (~/.ray/auth_token, shared by every local
        # cluster); this head has its own, so the test behaves the same wherever it runs.
        self.token = secrets.token_hex(32)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
        self.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token, RAY_USAGE_STATS_ENABLED="0",
                        TOKENIZERS_PARALLELISM="false")
        command = [
            RAY_BIN, "start", "--head", "--block", f"--temp-dir={self.temp_dir}", f"--port={gcs_port}",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
            f"--ray-client-server-port={client_port}", f"--dashboard-agent-listen-port={agent_port}",
            f"--num-cpus={NUM_CPUS}", "--num-gpus=0", "--disable-usage-stats",
        ]
        with open(self.log_path, "w") as log:
            # A session of its own: Ctrl-C on pytest reaches pytest, whose finalizer stops the head.
            self.process = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def wait_until_ready(self) -> None:
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                pytest.fail(f"ray start exited with {self.process.returncode}:\n{self.log_path.read_text()}")
            try:
                request = urllib.request.Request(f"{self.address}/api/version", headers=self.auth_headers)
                with urllib.request.urlopen(request, timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the dashboard at {self.address} did not answer within {HEAD_START_TIMEOUT_S} s:\n"
                            f"{self.log_path.read_text()}")
            time.sleep(1)

    def stop(self) -> None:
        """Stop every process this head started: SIGTERM, SIGKILL what is left after TERM_GRACE_S,
        then check that none is left within STOP_TIMEOUT_S.

        Ray gives each worker a process group of its own, so the head's group alone misses them:
        the members are the head, its descendants and any process naming the temp dir."""
        members = processes_referencing(self.temp_dir)
        try:
            head = psutil.Process(self.process.pid)
            members += [head, *head.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
        members = list({process.pid: process for process in members}.values())
        send(members, signal.SIGTERM)
        _, alive = psutil.wait_procs(members, timeout=TERM_GRACE_S)
        # Whatever ignored SIGTERM, and whatever started while the rest stopped.
        send(alive + processes_referencing(self.temp_dir), signal.SIGKILL)
        self.process.wait(timeout=STOP_TIMEOUT_S)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while (left := processes_referencing(self.temp_dir)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"still running {STOP_TIMEOUT_S} s after stopping the head:\n{describe(left)}"
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def send(processes: list[psutil.Process], signum: int) -> None:
    for process in processes:
        try:
            process.send_signal(signum)  # psutil checks the pid still names the same process
        except psutil.NoSuchProcess:
            pass


@pytest.fixture
def ray_head():
    head = LocalHead()
    try:
        head.wait_until_ready()
        yield head
    finally:
        head.stop()


def submit_and_wait(head: LocalHead, entrypoint: list[str]) -> str:
    """`ray job submit` the entrypoint, wait for it to succeed, return its logs."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    submission_id = f"rlactors-{uuid.uuid4().hex[:8]}"
    submit = subprocess.run(
        [RAY_BIN, "job", "submit", "--address", head.address, "--submission-id", submission_id, "--no-wait",
         "--entrypoint-num-cpus", "1", "--working-dir", str(REPO_ROOT), "--runtime-env-json", json.dumps(RUNTIME_ENV),
         "--", *entrypoint],
        cwd=REPO_ROOT, env=head.env, capture_output=True, text=True, timeout=120)
    assert submit.returncode == 0, submit.stdout + submit.stderr
    client = JobSubmissionClient(head.address, headers=head.auth_headers)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    done = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
    while (status := client.get_job_status(submission_id)) not in done:
        if time.monotonic() > deadline:
            client.stop_job(submission_id)
            pytest.fail(f"job {submission_id} still {status} after {JOB_TIMEOUT_S} s; its logs:\n"
                        f"{client.get_job_logs(submission_id)}")
        time.sleep(2)
    logs = client.get_job_logs(submission_id)
    assert status == JobStatus.SUCCEEDED, (
        f"job {submission_id} {status}: {client.get_job_info(submission_id).message}\nits logs:\n{logs}")
    return logs


def test_submit_script_sends_the_runtime_env_tested_here():
    script = (REPO_ROOT / "examples" / "submit_ray_job.sh").read_text()
    assert f"--runtime-env-json '{json.dumps(RUNTIME_ENV)}'" in script
    assert "--entrypoint-num-cpus 1" in script


@pytest.mark.vllm
@pytest.mark.slow  # a Ray head and a job of its own; the quickstart's run settings: tests/examples (every example's checks)
def test_quickstart_runs_as_a_submitted_job(ray_head, tmp_path, tiny_model_dir):
    output_dir = tmp_path / "run"
    overrides = [
        f"model.path={tiny_model_dir}", "model.preset=tiny", "data.num_train_rows=64", "data.num_val_rows=8",
        "rollout.sampling.num_samples_per_prompt=4", "rollout.sampling.max_response_tokens=4",
        "rollout.validation_sampling.max_response_tokens=4", "pipeline.num_steps=2", "pipeline.batch_size_prompts=4",
        "pipeline.val_every_steps=0", "pipeline.resume=never", f"pipeline.output_dir={output_dir}",
    ]
    logs = submit_and_wait(ray_head, [PYTHON, "-m", "rlactors", "run", "examples/quickstart_cpu.yaml", *overrides])
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]
    assert_prints_little_and_logs_everything(logs, output_dir, num_steps=2)  # what `ray job logs` shows

    # A job imports the uploaded package (unpacked under the head's temp dir), not the installed one.
    logs = submit_and_wait(ray_head, [PYTHON, "-c", "import rlactors; print('rlactors from', rlactors.__file__)"])
    imported_from = next(line for line in logs.splitlines() if line.startswith("rlactors from ")).split()[-1]
    assert imported_from.startswith(ray_head.temp_dir), logs
