"""What every chaos scenario checks after its fault: nothing lost, nothing left behind.

    before = leftover_processes()                     # a Snapshot: what was there already
    ... run with a fault injected ...
    assert_no_leftovers(before, warm=warm_actors)     # no new engine core, reward worker, actor or PG
                                                      # left, but what the warm actors keep for the next run
    assert_each_prompt_once(ledger_rows, prompt_ids)  # trained exactly once or dropped with a reason
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import psutil
from conftest import TEST_SESSION_ENV

# Command-line fragments (process titles) of the processes a run starts outside Ray's own actor
# workers: vLLM's engine core and its workers, and the reward scorers' worker subprocesses.
ENGINE_CORE_MARKERS = ("VLLM::EngineCore", "EngineCore_", "VLLM::Worker")
REWARD_WORKER_MARKER = "rlactors.reward.scorer import worker_main"


def _describe(process: psutil.Process) -> str | None:
    """Its command line, if it is this test session's (`TEST_SESSION_ENV`, which every process the
    session starts inherits, re-parented orphans too): another session's runs are not ours to count."""
    try:
        if process.environ().get(TEST_SESSION_ENV) != os.environ[TEST_SESSION_ENV]:
            return None
        return " ".join(process.cmdline()) or process.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


class Snapshot(dict):
    """pid -> command line of the engine cores and reward workers alive when it was taken, plus the
    ids of the Ray actors and placement groups alive then (`assert_no_leftovers` ignores those)."""

    actor_ids: frozenset = frozenset()
    placement_group_ids: frozenset = frozenset()


def leftover_processes() -> Snapshot:
    """A `Snapshot` now: every live vLLM engine-core process and reward worker of this test session,
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


def kept_by(warm) -> Snapshot:
    """What `warm` (a `rlactors.pipelines.warm.WarmActors`) keeps for the next run: its engines'
    actors and vLLM processes, its trainer groups' rank actors, and their placement groups."""
    import ray

    kept = Snapshot()
    if warm is None or warm.kept is None:
        return kept
    for engine in warm.kept.engines:
        pid = ray.get(engine.health.remote(), timeout=60)["pid"]
        kept.update({child.pid: "kept" for child in psutil.Process(pid).children(recursive=True)})
    ranks = [worker for group in warm.kept.trainers.values() for worker in group.workers]
    kept.actor_ids = frozenset(actor._actor_id.hex() for actor in [*warm.kept.engines, *ranks])
    kept.placement_group_ids = frozenset(group.id.hex() for group, _ in warm.kept.placement.groups.values())
    return kept


def assert_no_leftovers(before: Snapshot | None = None, timeout_s: float = 30.0, warm=None) -> None:
    """Within `timeout_s`: no engine core, reward worker, run actor or placement group beyond those
    in `before` and those `warm` keeps for the next run (`kept_by`). Names what is left."""
    before = before if before is not None else Snapshot()
    deadline = time.monotonic() + timeout_s
    while True:
        kept = kept_by(warm)
        processes = {pid: text for pid, text in leftover_processes().items() if pid not in before and pid not in kept}
        actors = [f"{a['ActorClassName']} ({a['State']}, pid {a['Pid']})" for a in live_actors()
                  if a["ActorID"] not in before.actor_ids | kept.actor_ids]
        groups = [pg["placement_group_id"] for pg in live_placement_groups()
                  if pg["placement_group_id"] not in before.placement_group_ids | kept.placement_group_ids]
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
