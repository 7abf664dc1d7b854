"""The resource plan: which role runs on which node and device, with what Ray resources.

    cluster = ClusterShape.uniform(num_nodes=4, num_devices_per_node=8)   # or cluster_shape_from_ray()
    plan = make_plan(config, cluster)
    plan.feasible, plan.reason          # False, "needs 32 GPUs (...) in 4 nodes of 8; the cluster has 8 ..."
    plan.bundles                        # one Bundle per device: node, device, the roles sharing it

A pure function of the config and the cluster's shape: no Ray, no I/O. `rlactors.placement.cluster`
realises a plan as Ray placement groups, and every actor's Ray options come from it.

A *device* is one GPU; on a cluster without GPUs it is one CPU bundle (its CPUs are the sum of the
roles' `num_cpus_*`), so CPU runs go through the same plan.
- colocated: one pool of max(num_engines x tensor_parallel_size, trainer.num_workers) devices. Every
  role shares every device it is on (actor, reference and critic rank i on device i, rollout engine
  e's tensor-parallel rank t on device e x tensor_parallel_size + t), each with a fractional GPU
  request 1/(roles on that device), as veRL's resource pools do.
- async: a rollout pool of num_engines x tensor_parallel_size devices and a training pool of
  trainer.num_workers devices, disjoint; the trainer roles share the training devices.
- reward models (`reward.models`): role `reward/<name>`, rank = replica. A model with `own_devices`
  takes a device per replica in a `reward` pool after the others; otherwise its replicas share the
  colocated pool's devices, or in async mode the training pool's, one replica per device in turn
  (the replicas of all such models counted together, so two models start on different devices).
Layout: a pool takes devices node by node and never goes back to an earlier node, so ranks are in
node order; it uses only nodes no earlier pool touched when it fits in them (pools on whole nodes);
an engine's tensor-parallel ranks never straddle two nodes. On CPU an engine is one device whatever
its tensor-parallel size (vLLM's CPU workers run inside the engine's bundle).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

TRAINER_ROLES = ("actor", "reference", "critic")
ROLLOUT = "rollout"


@dataclass(frozen=True)
class Node:
    node_id: str  # Ray node id, or "node-0", "node-1", ... for a shape given by hand
    num_gpus: int
    num_cpus: float | None = None  # None: not known, not checked


@dataclass(frozen=True)
class ClusterShape:
    nodes: tuple[Node, ...]

    @classmethod
    def uniform(cls, num_nodes: int, num_devices_per_node: int, num_cpus_per_node: float | None = None
                ) -> ClusterShape:
        return cls(tuple(Node(f"node-{i}", num_devices_per_node, num_cpus_per_node) for i in range(num_nodes)))

    @property
    def device_kind(self) -> str:
        """"gpu" when any node has GPUs, else "cpu"."""
        return "gpu" if any(node.num_gpus for node in self.nodes) else "cpu"

    @property
    def num_gpus(self) -> int:
        return sum(node.num_gpus for node in self.nodes)

    @property
    def num_cpus(self) -> float | None:
        counts = [node.num_cpus for node in self.nodes]
        return None if None in counts else sum(counts)

    def describe(self) -> str:
        """"8 GPUs (1 node of 8)", "16 GPUs (nodes of 8, 4, 4)", "2 CPUs (2 nodes of 1)"; nodes
        without GPUs (a CPU-only head) are left out of a GPU cluster's count."""
        kind = self.device_kind
        sizes = [node.num_gpus if kind == "gpu" else node.num_cpus for node in self.nodes
                 if kind == "cpu" or node.num_gpus]
        total = self.num_gpus if kind == "gpu" else self.num_cpus
        unit = "GPUs" if kind == "gpu" else "CPUs"
        if total is None:
            return f"{len(self.nodes)} CPU nodes of unknown size"
        if len(set(sizes)) == 1:
            nodes = f"{len(sizes)} node{'s' * (len(sizes) != 1)} of {_number(sizes[0])}"
        else:
            nodes = "nodes of " + ", ".join(_number(size) for size in sizes)
        return f"{_number(total)} {unit} ({nodes})"


@dataclass(frozen=True)
class RoleSlot:
    """One role's share of one device. `rank` is the trainer rank, or the engine index for rollout."""

    role: str
    rank: int
    tp_rank: int = 0
    num_gpus: float = 0.0
    num_cpus: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.role}:{self.rank}" + (f"/tp{self.tp_rank}" if self.role == ROLLOUT else "")


@dataclass
class Bundle:
    """One device: a Ray placement-group bundle on node `node` (an index into the cluster's nodes)."""

    index: int
    pool: str  # "shared" (colocated), "rollout" or "training"
    roles: list[RoleSlot]
    node: int = -1
    device: int = -1  # index of the device on its node

    @property
    def num_cpus(self) -> float:
        return sum(role.num_cpus for role in self.roles)

    def resources(self, device_kind: str) -> dict[str, float]:
        resources = {"CPU": self.num_cpus} if self.num_cpus else {}
        return {"GPU": 1.0, **resources} if device_kind == "gpu" else resources


@dataclass
class ResourcePlan:
    mode: str
    device_kind: str
    cluster: ClusterShape
    bundles: list[Bundle]
    num_cpus_elsewhere: float = 0.0  # reward scorers, scheduled outside the bundles
    feasible: bool = True
    reason: str = ""
    roles_needed: list[str] = field(default_factory=list)

    def bundle_of(self, role: str, rank: int, tp_rank: int = 0) -> tuple[Bundle, RoleSlot]:
        for bundle in self.bundles:
            for slot in bundle.roles:
                if (slot.role, slot.rank, slot.tp_rank) == (role, rank, tp_rank):
                    return bundle, slot
        raise KeyError(f"the plan has no {role} rank {rank} (tp rank {tp_rank})")

    def engine_bundles(self, engine: int) -> list[Bundle]:
        """The bundles of engine `engine`'s tensor-parallel ranks, in tp-rank order."""
        found = sorted(((slot.tp_rank, bundle) for bundle in self.bundles for slot in bundle.roles
                        if slot.role == ROLLOUT and slot.rank == engine), key=lambda item: item[0])
        return [bundle for _, bundle in found]

    @property
    def num_devices(self) -> int:
        return len(self.bundles)

    def to_dict(self) -> dict:
        return {
            "feasible": self.feasible,
            "reason": self.reason,
            "mode": self.mode,
            "device_kind": self.device_kind,
            "cluster": self.cluster.describe(),
            "num_devices": self.num_devices,
            "devices": [
                {"node": self.cluster.nodes[b.node].node_id if b.node >= 0 else None, "device": b.device,
                 "pool": b.pool, "roles": [slot.name for slot in b.roles],
                 "resources": b.resources(self.device_kind),
                 "role_resources": {slot.name: {"num_gpus": slot.num_gpus, "num_cpus": slot.num_cpus}
                                    for slot in b.roles}}
                for b in self.bundles
            ],
            "num_cpus_elsewhere": self.num_cpus_elsewhere,
        }


class PlanError(ValueError):
    """The plan cannot be realised on the cluster; the message names the missing resource."""


def needs_reference_policy(config) -> bool:
    """Whether a KL term (in the loss or the reward) needs the reference policy's logprobs."""
    return config.algorithm.use_kl_loss or config.algorithm.use_kl_in_reward


def trainer_roles(config) -> list[str]:
    """The trainer groups a run needs: actor always, reference for a KL term (unless the actor
    trains LoRA adapters: its base, adapters off, is the reference), critic for GAE."""
    algorithm = config.algorithm
    return (["actor"] + ["reference"] * (needs_reference_policy(config) and not config.model.lora.enabled)
            + ["critic"] * (algorithm.advantage == "gae"))


def reward_model_role(name: str) -> str:
    """The plan's role of reward model `name` (`reward.models`), its replicas the ranks."""
    return f"reward/{name}"


def reward_model_slots(config) -> list[tuple]:
    """(model's settings, its slot) for every replica of every reward model, in config order."""
    return [(model, RoleSlot(reward_model_role(model.name), replica, num_cpus=model.num_cpus_per_replica))
            for model in config.reward.models for replica in range(model.num_replicas)]


def make_plan(config, cluster: ClusterShape) -> ResourcePlan:
    """The resource plan of `config` (a `rlactors.config.Config`) on `cluster`; see the module doc.
    Never raises for a plan that does not fit: `feasible` is False and `reason` says why."""
    rollout, trainer, mode = config.rollout, config.trainer, config.pipeline.mode
    kind = cluster.device_kind
    devices_per_engine = rollout.tensor_parallel_size if kind == "gpu" else 1
    num_rollout_devices = rollout.num_engines * devices_per_engine
    roles = trainer_roles(config)

    def trainer_slots(rank: int) -> list[RoleSlot]:
        return [RoleSlot(role, rank, num_cpus=trainer.num_cpus_per_worker) for role in roles]

    def engine_slot(index: int) -> RoleSlot:
        engine, tp_rank = divmod(index, devices_per_engine)
        # The engine actor (tp rank 0) holds the CPUs; vLLM's own workers on the other ranks take none.
        return RoleSlot(ROLLOUT, engine, tp_rank, num_cpus=rollout.num_cpus_per_engine if tp_rank == 0 else 0.0)

    if mode == "colocated":
        size = max(num_rollout_devices, trainer.num_workers)
        pools = {"shared": [
            (trainer_slots(d) if d < trainer.num_workers else []) + ([engine_slot(d)] if d < num_rollout_devices else [])
            for d in range(size)]}
    else:
        pools = {"rollout": [[engine_slot(d)] for d in range(num_rollout_devices)],
                 "training": [trainer_slots(rank) for rank in range(trainer.num_workers)]}
    host = pools["shared" if mode == "colocated" else "training"]
    shared = [slot for model, slot in reward_model_slots(config) if not model.own_devices]
    for index, slot in enumerate(shared):
        host[index % len(host)].append(slot)
    own = [[slot] for model, slot in reward_model_slots(config) if model.own_devices]
    if own:
        pools["reward"] = own
    bundles: list[Bundle] = []
    for pool, devices in pools.items():
        for slots in devices:
            share = math.floor(10_000 / len(slots)) / 10_000 if kind == "gpu" else 0.0  # Ray counts in 1e-4
            bundles.append(Bundle(len(bundles), pool, [RoleSlot(s.role, s.rank, s.tp_rank, share, s.num_cpus)
                                                       for s in slots]))
    plan = ResourcePlan(mode, kind, cluster, bundles,
                        roles_needed=roles + [ROLLOUT] + list(dict.fromkeys(slot.role for _, slot in reward_model_slots(config))),
                        num_cpus_elsewhere=config.reward.num_workers * config.reward.num_cpus_per_worker)
    empty = [slot.name for b in bundles if kind == "cpu" and not b.num_cpus for slot in b.roles]
    plan.reason = (f"on CPU a device is a bundle of its roles' CPUs; {', '.join(empty)} ask for none (set "
                   "reward.models[].num_cpus_per_replica above 0, or share devices)" if empty
                   else _lay_out(plan, devices_per_engine))
    plan.feasible = not plan.reason
    return plan


def _lay_out(plan: ResourcePlan, devices_per_engine: int) -> str:
    """Assign every bundle a node and device; returns "" or the reason it cannot be done."""
    cluster, kind = plan.cluster, plan.device_kind
    if not cluster.nodes:
        return "the cluster has no nodes"
    capacity = [float(node.num_gpus) if kind == "gpu" else (math.inf if node.num_cpus is None else node.num_cpus)
                for node in cluster.nodes]

    def cost(bundle: Bundle) -> float:
        return 1.0 if kind == "gpu" else bundle.num_cpus

    unit = "GPUs" if kind == "gpu" else "CPUs"
    total = sum(cost(b) for b in plan.bundles)
    pools = list(dict.fromkeys(b.pool for b in plan.bundles))
    needs = f"needs {_number(total)} {unit}" + (
        " (" + " + ".join(f"{_number(sum(cost(b) for b in plan.bundles if b.pool == p))} {p}" for p in pools) + ")"
        if len(pools) > 1 else "")
    if kind == "gpu" and devices_per_engine > max(capacity):
        return (f"rollout.tensor_parallel_size={devices_per_engine} needs {devices_per_engine} GPUs on one node; "
                f"the largest node has {_number(max(capacity))}: an engine's tensor-parallel ranks must share a node")
    if total > sum(capacity):
        largest = max(capacity)
        in_nodes = f" in {math.ceil(total / largest)} nodes of {_number(largest)}" if kind == "gpu" else ""
        return f"{needs}{in_nodes}; the cluster has {cluster.describe()}"
    used = [0.0] * len(capacity)
    for pool in pools:
        members = [b for b in plan.bundles if b.pool == pool]
        untouched = [i for i, u in enumerate(used) if u == 0]
        fits_untouched = sum(cost(b) for b in members) <= sum(capacity[i] for i in untouched)
        candidates = untouched if fits_untouched else list(range(len(capacity)))
        # Units that must share a node: an engine's tp ranks; every other bundle on its own.
        units: list[list[Bundle]] = []
        for bundle in members:
            if units and any(s.role == ROLLOUT and s.tp_rank > 0 for s in bundle.roles):
                units[-1].append(bundle)
            else:
                units.append([bundle])
        cursor = 0
        for members_of_unit in units:
            need = sum(cost(b) for b in members_of_unit)
            while cursor < len(candidates) and capacity[candidates[cursor]] - used[candidates[cursor]] < need - 1e-9:
                cursor += 1
            if cursor == len(candidates):
                names = ", ".join(s.name for b in members_of_unit for s in b.roles)
                return f"{needs}; cannot place {pool} devices ({names}) on {cluster.describe()} after the earlier ones"
            node = candidates[cursor]
            for bundle in members_of_unit:
                bundle.node = node
                bundle.device = sum(1 for b in plan.bundles if b.node == node) - 1
                used[node] += cost(bundle)
    return _check_cpus(plan)


def _check_cpus(plan: ResourcePlan) -> str:
    """GPU nodes: the bundles' CPUs fit each node's CPUs. All clusters: the total with scorers fits."""
    cluster = plan.cluster
    if plan.device_kind == "gpu":
        for index, node in enumerate(cluster.nodes):
            on_node = sum(b.num_cpus for b in plan.bundles if b.node == index)
            if node.num_cpus is not None and on_node > node.num_cpus + 1e-9:
                return (f"node {node.node_id} needs {_number(on_node)} CPUs for its devices' roles "
                        f"(trainer.num_cpus_per_worker, rollout.num_cpus_per_engine); it has {_number(node.num_cpus)}")
    total = sum(b.num_cpus for b in plan.bundles) + plan.num_cpus_elsewhere
    if cluster.num_cpus is not None and total > cluster.num_cpus + 1e-9:
        return (f"needs {_number(total)} CPUs ({_number(plan.num_cpus_elsewhere)} of them reward scorers); "
                f"the cluster has {_number(cluster.num_cpus)} CPUs")
    return ""


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
