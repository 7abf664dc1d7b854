"""Sleep mode of a rollout engine (colocated runs): which of vLLM's allocations sleep, and the order
they wake in.

`sleep()` pauses generation and, on CUDA/ROCm, frees the KV cache and offloads the weights to host
memory (`rollout.sleep_level` 1) or discards them (level 2); on CPU vLLM cannot free memory, so it
only pauses (and with `rollout.suspend_while_asleep` stops vLLM's processes between calls,
`rlactors.rollout.engine_core.VllmCalls`). `generate` while asleep raises. The wake order is
weights, new weights, KV cache: a weight update while asleep wakes the weights only (vLLM tag
"weights") and loads them, then `wake_up()` wakes the rest ("kv_cache") and generation resumes.
After a level-2 sleep, waking the weights without a load is an error (they hold nothing).
"""

from __future__ import annotations

SLEEP_TAGS = ("weights", "kv_cache")  # vLLM's sleep-mode allocation tags, in wake order


def tags_to_wake(sleeping_tags: list[str], tags: list[str] | None, weights_discarded: bool) -> list[str]:
    """Which of `sleeping_tags` a `wake_up(tags)` wakes (None: all), in wake order; raises
    ValueError for a tag vLLM does not have, RuntimeError for weights a level-2 sleep discarded."""
    unknown = set(tags or ()) - set(SLEEP_TAGS)
    if unknown:
        raise ValueError(f"wake_up tags {sorted(unknown)}: allowed values are {list(SLEEP_TAGS)}")
    wake = [tag for tag in sleeping_tags if tags is None or tag in tags]
    if "weights" in wake and weights_discarded:
        raise RuntimeError("the level-2 sleep discarded the weights: load new ones (a weight sync) before "
                           "wake_up, which then wakes the KV cache")
    return wake
