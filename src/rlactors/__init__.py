"""rlactors: Ray-native actors for RL post-training of LLMs.

Importing the package is cheap: it neither imports vLLM nor starts Ray. Actors live in their own
modules (`rlactors.rollout`, `rlactors.reward`, `rlactors.buffer`, `rlactors.trainer`) and are
imported where used.
"""

__version__ = "0.1.0"
