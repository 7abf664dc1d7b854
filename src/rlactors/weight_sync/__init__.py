"""Weight syncs from a trainer to rollout engines, through vLLM's weight-transfer API.

    from rlactors.weight_sync.choice import choose_transport     # which transport, pure
    from rlactors.weight_sync.sender import WeightSender          # one trainer rank's side of a sync

Importing this package imports neither Ray nor vLLM; `sender`, `trainer_engines`, `source` and
`vllm_engine` import vLLM's weight-transfer base classes.
"""
