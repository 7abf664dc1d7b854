"""A LoRA run's adapter in a rollout engine (`RolloutEngine.load_adapter`).

vLLM loads LoRA adapters by path only (`LoRARequest`); its weight-transfer engines carry base
weights alone. So the trainer writes each version's adapter as a peft folder where the engines can
read it (`rlactors.weight_sync.adapters`), and each engine loads it in place of the last one under
one name and id (`load_inplace`, inside the update's pause), then names it on every request. The
flag is on the load alone: a request whose `LoRARequest` had it would reload the adapter from disk
at every scheduler step it is in.
"""

from __future__ import annotations

from pathlib import Path

ADAPTER_NAME, ADAPTER_ID = "policy", 1  # the one adapter an engine serves; each version replaces the last
SERVED_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed `max_lora_rank` values


def served_rank(rank: int) -> int:
    """vLLM's `max_lora_rank` for adapters of `rank`: the smallest value it allows that holds them."""
    for served in SERVED_RANKS:
        if served >= rank:
            return served
    raise ValueError(f"model.lora.rank={rank}: vLLM serves LoRA ranks up to {SERVED_RANKS[-1]} "
                     "(set model.lora.merge=true to send merged weights instead)")


async def load_adapter_in_vllm(vllm, folder: str, policy_version: int):
    """Load the adapter in `folder` through the engine's `VllmCalls` `vllm`, replacing the served
    one, drop the prefix cache (the KV of the last adapter; vLLM 0.32 also keys its blocks by the
    adapter's name and path, and each version has its own folder) and label later tokens
    `policy_version`. Returns the `LoRARequest` requests name it by."""
    from vllm.lora.request import LoRARequest

    llm = vllm.llm
    if not await vllm("load_adapter", llm.add_lora(LoRARequest(ADAPTER_NAME, ADAPTER_ID, folder, load_inplace=True))):
        raise RuntimeError(f"load_adapter: vLLM did not load the adapter in {folder}")
    await vllm("load_adapter", llm.reset_prefix_cache())
    await vllm("load_adapter", llm.update_weight_version(str(policy_version)))
    return LoRARequest(ADAPTER_NAME, ADAPTER_ID, folder)


def adapter_bytes(folder: str | Path) -> int:
    """Bytes of the adapter's tensors file (what a sync moves)."""
    from rlactors.models.lora import ADAPTER_WEIGHTS_FILE

    return (Path(folder) / ADAPTER_WEIGHTS_FILE).stat().st_size
