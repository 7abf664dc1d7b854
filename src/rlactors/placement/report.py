"""`python -m rlactors plan CONFIG [key=value ...] [--nodes N --devices-per-node G] [--json]`:
the run's layout, a per-device memory estimate, and whether it fits, before anything starts.

Without `--nodes` the shape is the live cluster's (RAY_ADDRESS) or this machine's. Exit code 0 when
the plan fits, 2 when it does not (with a one-line reason naming the resource).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

from rlactors.placement.memory import (
    adapter_parameter_count,
    estimate_memory,
    memory_verdict,
    parameter_counts,
    reward_model_parameter_counts,
)
from rlactors.placement.plan import ClusterShape, make_plan
from rlactors.weight_sync.choice import choose_for_plan

GiB = 1 << 30


def cluster_shape(num_nodes: int | None, num_devices_per_node: int | None, num_cpus_per_node: float | None
                  ) -> ClusterShape:
    """The shape given on the command line, else the live cluster's (RAY_ADDRESS), else this machine's."""
    if num_nodes is not None:
        return ClusterShape.uniform(num_nodes, num_devices_per_node or 0, num_cpus_per_node)
    if num_devices_per_node is not None:
        raise ValueError("--devices-per-node needs --nodes")
    from rlactors.placement.cluster import cluster_shape_from_ray, local_cluster_shape

    if os.environ.get("RAY_ADDRESS"):
        import ray

        ray.init(logging_level="ERROR", log_to_driver=False)
        try:
            return cluster_shape_from_ray()
        finally:
            ray.shutdown()
    return local_cluster_shape()


def plan_report(config, cluster: ClusterShape, device_memory_bytes: int | None = None) -> dict:
    """The plan as a JSON-ready dict, with `memory` rows when the model's config.json is readable;
    `feasible` is False when the devices, the CPUs or (with a device size) the memory do not fit."""
    plan = make_plan(config, cluster)
    report = plan.to_dict()
    try:
        num_parameters, num_active_parameters = parameter_counts(config.model.path) or (None, None)
    except ValueError as error:
        num_parameters, num_active_parameters, report["memory_note"] = None, None, str(error)
    report["num_parameters"], report["num_active_parameters"] = num_parameters, num_active_parameters
    report["num_adapter_parameters"] = adapter_parameter_count(config.model.path, config.model.lora) \
        if num_parameters is not None and config.model.lora.enabled else None
    report["device_memory_bytes"] = device_memory_bytes
    if num_parameters is None:
        report.setdefault("memory_note", f"no readable {config.model.path}/config.json: memory not estimated")
    elif plan.feasible:
        try:
            report["reward_model_parameters"] = reward_model_parameter_counts(config)
        except ValueError as error:
            report["reward_model_parameters"], report["memory_note"] = {}, f"reward models not counted: {error}"
        report["memory"] = estimate_memory(plan, config, num_parameters, device_memory_bytes,
                                           report["num_adapter_parameters"] or 0, report["reward_model_parameters"])
        verdict = memory_verdict(report["memory"], device_memory_bytes)
        if verdict:
            report["feasible"], report["reason"] = False, verdict
    if plan.feasible:
        try:
            choice = choose_for_plan(config.rollout.weight_transport, plan, config.rollout.num_engines,
                                     config.pipeline.mode == "colocated")
            report["weight_transport"], report["weight_transport_reason"] = choice.transport, choice.reason
            if config.rollout.lora_rank:  # the adapter alone, by path (rlactors.weight_sync.adapters)
                report["weight_transport"], report["weight_transport_reason"] = (
                    "adapter", "LoRA: the adapter alone, as a peft folder the engines load by path")
        except ValueError as error:
            report["feasible"], report["reason"] = False, str(error)
    return report


def format_report(report: dict) -> str:
    """The report as the text table `plan` prints."""
    verdict = "fits" if report["feasible"] else f"does not fit: {report['reason']}"
    lines = [f"{report['mode']} run on {report['cluster']}: {report['num_devices']} devices; {verdict}"]
    if report["feasible"] or report["devices"][0]["node"] is not None:
        lines.append(f"{'node':<14}{'device':>7}  {'GPU share':>9}  {'CPUs':>5}  roles")
        for device in report["devices"]:
            if device["node"] is None:
                continue
            shares = {r["num_gpus"] for r in device["role_resources"].values()}
            share = f"{max(shares):.4g}" if report["device_kind"] == "gpu" else "-"
            lines.append(f"{str(device['node'])[:14]:<14}{device['device']:>7}  {share:>9}  "
                         f"{device['resources'].get('CPU', 0):>5g}  {' '.join(device['roles'])}")
    if report.get("weight_transport"):
        lines.append(f"weight sync: {report['weight_transport']} ({report['weight_transport_reason']})")
    if report.get("memory"):
        size = report["device_memory_bytes"]
        active = report.get("num_active_parameters") or report["num_parameters"]
        counts = f"{report['num_parameters'] / 1e9:.2f}B parameters" + (
            f", {active / 1e9:.2f}B active per token" if active != report["num_parameters"] else "") + (
            f", {report['num_adapter_parameters'] / 1e6:.1f}M in LoRA adapters trained"
            if report.get("num_adapter_parameters") else "")
        lines.append(f"memory per device, GiB ({counts}; activations not "
                     f"counted; device size {'%.0f GiB' % (size / GiB) if size else 'unknown: pass --device-memory-gib'}):")
        keys = [k for k in ("actor_bytes", "reference_bytes", "critic_bytes", "rollout_weights_bytes", "kv_cache_bytes",
                            "reward_models_bytes", "peak_bytes") if any(k in row for row in report["memory"])]
        lines.append(f"{'node':>5}{'device':>7}" + "".join(f"{k.removesuffix('_bytes'):>17}" for k in keys)
                     + ("   fits" if size else ""))
        for row in report["memory"]:
            cells = "".join(f"{row[k] / GiB:>17.2f}" if k in row else f"{'-':>17}" for k in keys)
            lines.append(f"{row['node']:>5}{row['device']:>7}{cells}" + (f"   {row['fits']}" if size else ""))
    elif report.get("memory_note"):
        lines.append(f"memory: {report['memory_note']}")
    return "\n".join(lines)


def plan_main(config, num_nodes: int | None, num_devices_per_node: int | None, num_cpus_per_node: float | None,
              device_memory_gib: float | None, as_json: bool) -> int:
    # stdout carries the report alone: what Ray or vLLM print while the plan is made (vLLM 0.27 logs
    # to stdout as it is imported, for the weight transport) goes to stderr.
    with contextlib.redirect_stdout(sys.stderr):
        cluster = cluster_shape(num_nodes, num_devices_per_node, num_cpus_per_node)
        device_memory_bytes = int(device_memory_gib * GiB) if device_memory_gib else None
        report = plan_report(config, cluster, device_memory_bytes)
    print(json.dumps(report) if as_json else format_report(report))
    return 0 if report["feasible"] else 2

