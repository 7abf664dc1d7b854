"""What every chaos scenario checks after its fault: nothing lost, nothing left behind.

    before = leftover_processes()                 # a Snapshot: what was there already
    ... run with a fault injected ...
    assert_no_leftovers(before)                   # no new vLLM engine core, reward worker, actor or PG left
    assert_each_prompt_once(ledger_rows, prompt_ids)  # trained exactly once or dropped with a reason
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import psutil

# Command-line fragments (process titles) of the processes a run starts outside Ray's own actor
# workers: vLLM's engine core and its workers, and the reward scorers' worker subprocesses.
ENGINE_CORE_MARKERS = ("VLLM::EngineCore", "EngineCore_", "VLLM::Worker")
REWARD_WORKER_MARKER = "rlactors.reward.scorer import worker_main"


def _describe(process: psutil.Process) -> str | None:
    try:
        return " ".join(process.cmdline()) or process.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


class Snapshot(dict):
    """pid -> command line of the engine cores and reward workers alive when it was taken, plus the
    ids of the Ray actors and placement groups alive then (`assert_no_leftovers` ignores those)."""

    actor_ids: frozenset = frozenset()
    placement_group_ids: frozenset = frozenset()


def leftover_processes() -> Snapshot:
    """A `Snapshot` now: every live vLLM engine-core process and reward worker on this machine,
    and (when Ray is initialised) the live actors and placement groups of the current cluster."""
    import ray

    found = Snapshot()
    for process in psutil.process_iter():
        text = _describe(process)
        if text and (any(m in text for m in ENGINE_CORE_MARKERS) or REWARD_WORKER_MARKER in text):
            try:
                if process.status() != psutil.STATUS_ZOMBIE:
                    found[process.pid] = text[:200]
            except psutil.NoSuchProcess:
                continue
    if ray.is_initialized():
        found.actor_ids = frozenset(actor["ActorID"] for actor in live_actors())
        found.placement_group_ids = frozenset(pg["placement_group_id"] for pg in live_placement_groups())
    return found


def live_actors(class_names: tuple[str, ...] = ("RolloutEngine", "TrainerWorker", "ReplayBuffer", "RewardScorer",
                                                "BatchBuilder")) -> list[dict]:
    """The run's actors the cluster's control store still has alive, starting or restarting (read
    from the GCS directly: the state API needs the dashboard, which the tests do not start)."""
    from ray._private.state import actors

    return [actor for actor in actors().values()
            if actor["State"] in ("DEPENDENCIES_UNREADY", "PENDING_CREATION", "ALIVE", "RESTARTING")
            and any(name in actor["ActorClassName"] for name in class_names)]


def live_placement_groups() -> list[dict]:
    import ray

    return [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]


def assert_no_leftovers(before: Snapshot | None = None, timeout_s: float = 30.0) -> None:
    """Within `timeout_s`: no engine core, reward worker, run actor or placement group beyond those
    in `before`. Names what is left."""
    before = before if before is not None else Snapshot()
    deadline = time.monotonic() + timeout_s
    while True:
        processes = {pid: text for pid, text in leftover_processes().items() if pid not in before}
        actors = [f"{a['ActorClassName']} ({a['State']}, pid {a['Pid']})" for a in live_actors()
                  if a["ActorID"] not in before.actor_ids]
        groups = [pg["placement_group_id"] for pg in live_placement_groups()
                  if pg["placement_group_id"] not in before.placement_group_ids]
        if not (processes or actors or groups):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left after the run: processes {processes}, actors {actors}, placement groups {groups}")
        time.sleep(0.5)


def checkpoint_ledger(output_dir: str | Path) -> list[dict]:
    """Every ledger row (epoch, prompt_id, status, reason, ...) as of the run's latest checkpoint:
    the finished rows in the run's ledger log up to the checkpoint's cut, then its in-flight rows."""
    from rlactors.buffer import read_checkpoint_ledger
    from rlactors.buffer.ledger_log import LEDGER_FOLDER

    root = Path(output_dir) / "checkpoints"
    latest = root / (root / "latest").read_text().strip()
    return read_checkpoint_ledger(latest / "buffer", Path(output_dir) / LEDGER_FOLDER)


def assert_each_prompt_once(ledger: list[dict], prompt_ids: set[str] | None = None) -> Counter:
    """Every (epoch, prompt_id) in the ledger ends trained or dropped-with-a-reason, exactly one row
    each, and (if given) every prompt in `prompt_ids` appears in some epoch. Returns the status counts."""
    keys = Counter((row["epoch"], row["prompt_id"]) for row in ledger)
    duplicated = [key for key, count in keys.items() if count > 1]
    assert not duplicated, f"ledger rows repeated for {duplicated[:5]}"
    for row in ledger:
        assert row["status"] in ("trained", "dropped", "pending", "reserved", "queued", "sampled"), row
        if row["status"] == "dropped":
            assert row["reason"], f"prompt_id={row['prompt_id']!r} dropped without a reason"
    if prompt_ids is not None:
        missing = prompt_ids - {row["prompt_id"] for row in ledger}
        assert not missing, f"prompts missing from the ledger: {sorted(missing)[:5]}"
    return Counter(row["status"] for row in ledger)
