"""Rollout: vLLM engines as Ray actors, and a router over replicas.

    from rlactors.rollout.engine import RolloutEngine, create_engine   # one vLLM engine actor
    from rlactors.rollout.router import RolloutRouter                  # data parallel over N engines
    from rlactors.weight_sync.sender import WeightSender               # trainer -> engines weight syncs

Importing this package does not import vLLM (it loads inside the engine actor when it starts).
"""
