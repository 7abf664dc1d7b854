"""Rollout: vLLM engines as Ray actors, and a router over replicas.

    from rlactors.rollout.engine import RolloutEngine, create_engine   # one vLLM engine actor
    from rlactors.rollout.router import RolloutRouter                  # data parallel over N engines
    from rlactors.rollout.weights import split_into_buckets            # the weight-update format

Importing this package does not import vLLM (it loads inside the engine actor when it starts).
"""
