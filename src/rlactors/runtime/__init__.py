"""The ground floor: how every actor and driver runs on Ray, below all other packages (it imports
none of them).

    calls         every wait on an actor bounded, every error turned into text one way
    transport     actor results kept in the object store, so rollout data skips the driver
    device        platform detection (CPU, CUDA, ROCm) and an engine process's environment
    vllm_features what the installed vLLM offers the rollout engine and the weight transports
    logs          what reaches the terminal, and each process's full log file
    session       the node's folder of the current Ray session (notes that outlive an actor)
    phases        per-actor phase logs: what an actor did when, and its memory then
    parent_death  a process signalled when its parent dies (no orphans after a kill)
    durable       durable writes: fsync, rename, fsync the directory
    user_code     loading a user's object from `package.module:name` or `path/file.py:name`
"""
