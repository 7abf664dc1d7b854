"""Weight sync: trainer -> rollout engine over `shm` and `object_store`, against a plain memcpy.

The sender is a real trainer rank: a one-rank `TrainerGroup` (FSDP2 on gloo) of the `medium`
preset (~113M parameters, ~452 MB in float32, the CPU engines' dtype), syncing through
`TrainerGroup.send_weights` as a run does. Each transport gets its own RolloutEngine and its own
`WeightSender` on the rank (swapped in before each of its syncs): an engine keeps the transport of
the sender that set it up last, so one engine and one sender for both would start the transport
afresh at every switch, and the syncs measured would be first syncs. One warm-up sync each, then
`--num-syncs` syncs each, alternating the transports so that this machine's drift hits both alike.
While one engine loads, the other's vLLM processes are stopped (SIGSTOP), as in
benchmarks/rollout_throughput.py: an idle vLLM worker wakes its threads ~100 times a second.

Per sync: `weight_sync_s` (the sender's figure: start_weight_update to finish_weight_update, every
bucket gathered, copied and loaded by vLLM's layerwise reload), the bytes, and the peak extra host
memory of the trainer rank (the sender's `peak_extra_bytes`) and of the engine's vLLM worker
(`worker_memory("start")` before the sync, `worker_memory("peak")` after): the largest of the timed
syncs in `peak_extra_bytes`, the warm-up's in `first_sync_peak_extra_bytes` (an shm sender maps its
two segments at its first sync and keeps them, so later syncs add nothing to them);
`rss_growth_bytes` is the growth of each process's resident memory over the warm-ups
(`first_sync`) and then over the timed syncs (`timed_syncs`: near zero unless a sync leaks),
mapped shared memory included (the segments, the object store's pages it touched) as is what
its allocator keeps for the next sync; `uss_growth_bytes` the same of the memory only that process
maps. The baseline is a
plain in-process copy of the same bytes (torch `copy_` of every tensor into preallocated ones,
best of one pass after every round; `memcpy_1_thread_s` is the same with one torch thread, the
trainer rank's setting). `memcpy_ratio` is the median shm sync over the memcpy,
`object_store_memcpy_ratio` likewise. `sync_s` is the fixed cost: the median shm sync of the
`small` preset (~3M parameters). After the timed syncs one sync per transport runs with
verification on (sha256 of every tensor on both sides), so the figures are of syncs that arrive.

    .venv/bin/python benchmarks/weight_sync.py [--num-syncs 5] [--bucket-bytes N] [--reload-floors 5] [--breakdown]

The floor under any transport: `reload_floor_s` is vLLM's own layerwise reload of the same
tensors inside one process (`vllm.LLM` with its engine in-process, no Ray, nothing else running;
tensors already in memory, as the shm engine sees them), and `reload_floor_memcpy_ratio` is that
over a plain copy timed in the same process.

`--breakdown` times the pieces of each sync on the trainer rank (the engine calls, the gathers,
the sender's waits for the engine; the sender's own copying is the rest) and reports their medians.

Prints a short summary, then one final JSON line with memcpy_ratio, object_store_memcpy_ratio,
peak_extra_bytes (trainer and engine, per transport), sync_s, weight_bytes, num_syncs,
transports, bucket_bytes and the median seconds of each.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import psutil
import ray
import torch
from rollout_throughput import stopped, vllm_processes  # this folder: the script's own

from rlactors.config import RolloutConfig, TrainerConfig
from rlactors.models import PRESETS, build_tiny_model, load_model
from rlactors.weight_sync.choice import WeightSyncSettings

TRANSPORTS = ("shm", "object_store")




def instrument(worker) -> None:
    """On a trainer rank (through `__ray_call__`, `--breakdown`): time the pieces of every sync in
    `worker.sync_times` (seconds): the engine calls of the sender (`engine <method>`: start, each
    bucket's update in the sender's background thread, finish), the gathers, and the sender's
    waits for the engine to finish a bucket."""
    import collections

    from rlactors.weight_sync import client, source, trainer_engines

    worker.sync_times = collections.defaultdict(float)
    if getattr(client.EngineSyncClient, "benchmark_timed", False):
        return
    fan, wait, gather = client.EngineSyncClient._fan, trainer_engines.Pipeline.wait, source.NamedTensorSource.__iter__

    def timed_fan(self, method, arguments):
        start = time.perf_counter()
        try:
            return fan(self, method, arguments)
        finally:
            worker.sync_times["engine " + method] += time.perf_counter() - start

    def timed_wait(self):
        start = time.perf_counter()
        try:
            return wait(self)
        finally:
            worker.sync_times["sender waits for the engine"] += time.perf_counter() - start

    def timed_gather(self):
        tensors = gather(self)
        while True:
            start = time.perf_counter()
            item = next(tensors, None)
            worker.sync_times["gather"] += time.perf_counter() - start
            if item is None:
                return
            yield item

    client.EngineSyncClient._fan, trainer_engines.Pipeline.wait = timed_fan, timed_wait
    source.NamedTensorSource.__iter__ = timed_gather
    client.EngineSyncClient.benchmark_timed = True


def sync_times(worker) -> dict:
    times, worker.sync_times = dict(worker.sync_times), type(worker.sync_times)(float)
    return times


def use_sender(worker, transport: str) -> None:
    """On a trainer rank (through `__ray_call__`): make `transport`'s own WeightSender the rank's."""
    from rlactors.weight_sync.sender import WeightSender

    senders = worker.__dict__.setdefault("benchmark_senders", {})
    worker.weight_sender = senders.setdefault(transport, WeightSender(worker.rank))


class Sender:
    """A one-rank trainer group of `model_path` and one engine per transport."""

    def __init__(self, model_path: str, transports, bucket_bytes: int, rollout: RolloutConfig,
                 breakdown: bool = False, trainer_cpu_cores: list[int] | None = None):
        from rlactors.rollout.engine import create_engine
        from rlactors.trainer.group import TrainerGroup

        self.engines = {transport: create_engine(model_path, rollout) for transport in transports}
        self.trainer = TrainerGroup("actor", model_path, TrainerConfig(num_workers=1, num_cpus_per_worker=1,
                                                                       cpu_cores=trainer_cpu_cores))
        ray.get([engine.ready.remote() for engine in self.engines.values()])
        self.processes = {transport: vllm_processes(ray.get(engine.health.remote())["pid"])
                          for transport, engine in self.engines.items()}
        assert all(self.processes.values()), "vLLM's engine processes were not found"
        self.bucket_bytes = bucket_bytes
        self.version = 0
        self.breakdown = breakdown
        if breakdown:
            ray.get(self.trainer.workers[0].__ray_call__.remote(instrument))

    def resident_bytes(self, kind: str) -> dict:
        """Memory now (`kind`: rss, or uss, what only that process maps) of the trainer rank and of
        each engine's vLLM worker."""
        workers = {transport: [p for p in processes if "Worker" in p.name()] or processes
                   for transport, processes in self.processes.items()}

        def size(process: psutil.Process) -> int:
            return getattr(process.memory_full_info(), kind)

        return {"trainer": size(psutil.Process(self.trainer.info[0]["pid"])),
                "engine": {transport: sum(size(p) for p in processes) for transport, processes in workers.items()}}

    def others(self, transport: str | None) -> list[psutil.Process]:
        return [p for name, processes in self.processes.items() if name != transport for p in processes]

    def sync(self, transport: str, verify: bool = False) -> dict:
        """One sync over `transport`: the sender's figures, the driver's wall time and the engine's peak."""
        engine = self.engines[transport]
        self.version += 1
        settings = WeightSyncSettings(transport, self.bucket_bytes, None, call_timeout_s=600.0, verify=verify)
        ray.get(self.trainer.workers[0].__ray_call__.remote(use_sender, transport))
        with stopped(self.others(transport)):
            ray.get(engine.worker_memory.remote("start"))
            start = time.perf_counter()
            stats = self.trainer.send_weights({0: (engine, 0)}, self.version, settings)
            wall_s = time.perf_counter() - start
            engine_peak = ray.get(engine.worker_memory.remote("peak"))
        if stats["failed"] or stats["synced"] != [0]:
            raise RuntimeError(f"{transport} sync {self.version} failed: {stats['failed']}")
        stats |= {"wall_s": wall_s, "engine_peak_extra_bytes": engine_peak}
        if self.breakdown:
            times = ray.get(self.trainer.workers[0].__ray_call__.remote(sync_times))
            sender_s = stats["weight_sync_s"] - stats["init_s"] - sum(
                times.get(key, 0.0) for key in ("engine start_weight_update", "engine finish_weight_update",
                                                "gather", "sender waits for the engine"))
            stats["breakdown"] = times | {"sender copies (segments or ray.put)": sender_s}
        return stats

    def shutdown(self) -> None:
        self.trainer.shutdown()
        for engine in self.engines.values():
            ray.kill(engine)


def sent_tensors(model_path: str) -> list[tuple[str, torch.Tensor]]:
    """What a trainer sends of this model: its state dict, a tied lm_head once (as the embedding)."""
    model = load_model(model_path)
    seen, named = set(), []
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            named.append((name, tensor))
    return named


def memcpy_s(sources: list[torch.Tensor], targets: list[torch.Tensor], num_threads: int | None = None) -> float:
    """One plain copy of every tensor into its preallocated target."""
    previous = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        start = time.perf_counter()
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source)
        return time.perf_counter() - start
    finally:
        torch.set_num_threads(previous)


def reload_floor(model_path: str, num_reloads: int) -> dict:
    """In this process (started for it: vLLM's engine runs in-process only when told before import),
    time vLLM's layerwise reload of the model's own tensors, and a plain copy of them, alternately."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    from rlactors.rollout.vllm_args import engine_kwargs

    llm = LLM(**engine_kwargs(model_path, RolloutConfig(max_model_len=256), "cpu", "float32", seed=0))
    named = sent_tensors(model_path)
    sources = [tensor for _, tensor in named]
    targets = [torch.empty_like(tensor) for tensor in sources]

    def reloads(worker) -> list[float]:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        from rlactors.weight_sync.vllm_engine import refresh_tied_head

        model, times = worker.model_runner.model, []
        for _ in range(num_reloads + 1):  # the first is a warm-up
            start = time.perf_counter()
            initialize_layerwise_reload(model)
            model.load_weights(iter(named))
            finalize_layerwise_reload(model, worker.model_config)
            refresh_tied_head(model)
            times.append(time.perf_counter() - start)
            times.append(memcpy_s(sources, targets))
        return times

    times = llm.collective_rpc(reloads)[0][2:]
    reload_s, copy_s = statistics.median(times[0::2]), min(times[1::2])
    return {"reload_floor_s": round(reload_s, 4), "reload_floor_memcpy_s": round(copy_s, 4),
            "reload_floor_memcpy_ratio": round(reload_s / copy_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="medium", choices=sorted(PRESETS), help="the model of the timed syncs")
    parser.add_argument("--num-syncs", type=int, default=5, help="timed syncs of each transport, after one warm-up")
    parser.add_argument("--bucket-bytes", type=int, default=RolloutConfig().weight_bucket_bytes)
    parser.add_argument("--small-syncs", type=int, default=5, help="timed shm syncs of the small preset (0: none)")
    parser.add_argument("--breakdown", action="store_true", help="time the pieces of each sync on the trainer rank")
    parser.add_argument("--trainer-cpu-cores", default=None, help="comma-separated cores to pin the trainer rank to")
    parser.add_argument("--reload-floors", type=int, default=5, help="timed in-process vLLM reloads (0: none)")
    parser.add_argument("--reload-floor-of", default=None, help=argparse.SUPPRESS)  # the floor's own process
    args = parser.parse_args()
    if args.reload_floor_of:
        print(json.dumps(reload_floor(args.reload_floor_of, args.reload_floors)))
        return
    began = time.perf_counter()

    root = tempfile.mkdtemp(prefix="weight-sync-")
    atexit.register(shutil.rmtree, root, True)  # the models' folders (~0.5 GB)
    model_path = str(build_tiny_model(f"{root}/{args.preset}", preset=args.preset, seed=0))
    rollout = RolloutConfig(max_model_len=256)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    trainer_cores = [int(core) for core in args.trainer_cpu_cores.split(",")] if args.trainer_cpu_cores else None
    sender = Sender(model_path, TRANSPORTS, args.bucket_bytes, rollout, args.breakdown, trainer_cores)
    sources = [tensor for _, tensor in sent_tensors(model_path)]
    targets = [torch.empty_like(tensor) for tensor in sources]
    memcpy_bytes = sum(t.numel() * t.element_size() for t in sources)

    resident = [{kind: sender.resident_bytes(kind) for kind in ("rss", "uss")}]
    warmups = {transport: sender.sync(transport) for transport in TRANSPORTS}
    resident.append({kind: sender.resident_bytes(kind) for kind in ("rss", "uss")})
    syncs: dict[str, list[dict]] = {transport: [] for transport in TRANSPORTS}
    copies, copies_1_thread = [], []
    for _ in range(args.num_syncs):
        for transport in TRANSPORTS:
            syncs[transport].append(sender.sync(transport))
        with stopped(sender.others(None)):
            copies.append(memcpy_s(sources, targets))
            copies_1_thread.append(memcpy_s(sources, targets, num_threads=1))
    resident.append({kind: sender.resident_bytes(kind) for kind in ("rss", "uss")})
    verified = {transport: sender.sync(transport, verify=True)["weight_sync_s"] for transport in TRANSPORTS}
    sender.shutdown()

    small_syncs = []
    if args.small_syncs:
        small_path = str(build_tiny_model(f"{root}/small", preset="small", seed=0))
        small = Sender(small_path, ("shm",), args.bucket_bytes, rollout, trainer_cpu_cores=trainer_cores)
        small_stats = [small.sync("shm") for _ in range(args.small_syncs + 1)][1:]  # the first is a warm-up
        small.shutdown()
        small_syncs, small_bytes = [s["weight_sync_s"] for s in small_stats], small_stats[0]["weight_bytes"]
    ray.shutdown()
    floor = {}
    if args.reload_floors:  # after every engine is gone: the floor's process has the machine to itself
        command = [sys.executable, __file__, "--reload-floor-of", model_path, "--reload-floors", str(args.reload_floors)]
        floor = json.loads(subprocess.run(command, check=True, capture_output=True, text=True,
                                          timeout=900).stdout.strip().splitlines()[-1])

    weight_bytes = syncs["shm"][0]["weight_bytes"]
    assert weight_bytes == memcpy_bytes, (weight_bytes, memcpy_bytes)
    memcpy = min(copies)
    median = {transport: statistics.median(s["weight_sync_s"] for s in syncs[transport]) for transport in TRANSPORTS}
    peak = {side: {transport: max(s[key]["host"] for s in syncs[transport]) for transport in TRANSPORTS}
            for side, key in (("trainer", "peak_extra_bytes"), ("engine", "engine_peak_extra_bytes"))}
    for transport in TRANSPORTS:
        print(f"{transport}: syncs of {weight_bytes / 1e6:.0f} MB in",
              [round(s["weight_sync_s"], 3) for s in syncs[transport]], "s",
              f"(warm-up {warmups[transport]['weight_sync_s']:.3f} s, verified {verified[transport]:.3f} s);",
              f"median {median[transport]:.3f} s = {weight_bytes / median[transport] / 1e9:.2f} GB/s,",
              f"{median[transport] / memcpy:.1f}x memcpy; peak extra: trainer "
              f"{peak['trainer'][transport] / 1e6:.0f} MB, engine {peak['engine'][transport] / 1e6:.0f} MB")
    breakdown = {}
    if args.breakdown:
        for transport in TRANSPORTS:
            keys = sorted({key for s in syncs[transport] for key in s["breakdown"]})
            breakdown[transport] = {key: round(statistics.median(s["breakdown"].get(key, 0.0) for s in syncs[transport]), 4)
                                    for key in keys}
            print(f"{transport} breakdown (medians, s; the engine's bucket updates overlap the sender's work):",
                  ", ".join(f"{key} {value}" for key, value in breakdown[transport].items()))
    print(f"memcpy: best {memcpy:.3f} s ({weight_bytes / memcpy / 1e9:.2f} GB/s), "
          f"one thread {min(copies_1_thread):.3f} s; small model over shm: "
          + (f"{statistics.median(small_syncs):.3f} s" if small_syncs else "not run"))
    if floor:
        print(f"vLLM's own reload in one process: {floor['reload_floor_s']:.3f} s, "
              f"{floor['reload_floor_memcpy_ratio']:.1f}x that process's memcpy ({floor['reload_floor_memcpy_s']:.3f} s)")
    result = {
        "memcpy_ratio": round(median["shm"] / memcpy, 2),
        "object_store_memcpy_ratio": round(median["object_store"] / memcpy, 2),
        "peak_extra_bytes": peak,
        "first_sync_peak_extra_bytes": {  # the warm-up: a transport's segments are made then, and kept
            side: {transport: warmups[transport][key]["host"] for transport in TRANSPORTS}
            for side, key in (("trainer", "peak_extra_bytes"), ("engine", "engine_peak_extra_bytes"))},
        **{f"{kind}_growth_bytes": {  # over the warm-ups, then over the timed syncs
            phase: {"trainer": after[kind]["trainer"] - before[kind]["trainer"],
                    "engine": {t: after[kind]["engine"][t] - before[kind]["engine"][t] for t in TRANSPORTS}}
            for phase, before, after in (("first_sync", resident[0], resident[1]),
                                         ("timed_syncs", resident[1], resident[2]))}
           for kind in ("rss", "uss")},
        **floor,
        "sync_s": round(statistics.median(small_syncs), 4) if small_syncs else None,
        "small_weight_bytes": small_bytes if small_syncs else None,
        "weight_bytes": weight_bytes,
        "num_syncs": args.num_syncs,
        "transports": list(TRANSPORTS),
        "bucket_bytes": args.bucket_bytes,
        "num_buckets": syncs["shm"][0]["num_buckets"],
        "shm_sync_s": round(median["shm"], 4),
        "object_store_sync_s": round(median["object_store"], 4),
        "shm_wall_s": round(statistics.median(s["wall_s"] for s in syncs["shm"]), 4),
        "object_store_wall_s": round(statistics.median(s["wall_s"] for s in syncs["object_store"]), 4),
        "memcpy_s": round(memcpy, 4),
        "memcpy_1_thread_s": round(min(copies_1_thread), 4),
        "sender": "trainer",
        "trainer_cpu_cores": trainer_cores,
        **({"breakdown": breakdown} if args.breakdown else {}),
        "preset": args.preset,
        "elapsed_s": round(time.perf_counter() - began, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
