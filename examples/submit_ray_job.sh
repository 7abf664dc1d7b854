#!/usr/bin/env bash
# Submit a run to a Ray cluster (see Dockerfile.rocm for starting one on AMD Instinct nodes).
# The head's dashboard listens on its loopback only; tunnel to it, then submit:
#   ssh -N -L 8265:127.0.0.1:8265 <head> &
#   examples/submit_ray_job.sh examples/gsm8k_grpo_qwen3_8b.yaml model.path=/models/Qwen3-8B
# RAY_ADDRESS (default http://127.0.0.1:8265, the tunnel's end or a local `ray start --head`)
# picks another dashboard. CONFIG and paths in overrides are read on the cluster: CONFIG relative
# to this repository's root (uploaded as the job's working dir), model and data paths as the
# nodes see them. `python` is the first one on the head's PATH (the image's, in Dockerfile.rocm).
set -euo pipefail
config=${1:?usage: $0 CONFIG.yaml [key=value ...]}
shift
export RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
cd "$(dirname "$0")/.."
# py_modules: the uploaded src/rlactors goes first on the job's path (driver and every actor), so
# the job runs this checkout's code, not the copy installed in the image.
exec ray job submit --working-dir . --entrypoint-num-cpus 1 \
    --runtime-env-json '{"excludes": [".venv", "outputs", ".cache", ".git"], "py_modules": ["src/rlactors"]}' \
    -- python -m rlactors run "$config" "$@"
