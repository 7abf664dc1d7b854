#!/usr/bin/env bash
# Submit a run to a Ray cluster (see Dockerfile.rocm for starting one on AMD Instinct nodes).
#   RAY_ADDRESS=http://<head-ip>:8265 examples/submit_ray_job.sh examples/gsm8k_grpo_qwen3_8b.yaml model.path=/models/Qwen3-8B
# Without RAY_ADDRESS the job goes to a local cluster started by `ray start --head`.
set -euo pipefail
config=${1:?usage: $0 CONFIG.yaml [key=value ...]}
shift
export RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
cd "$(dirname "$0")/.."
exec ray job submit --working-dir . --entrypoint-num-cpus 1 \
    --runtime-env-json '{"excludes": [".venv", "outputs", ".cache", ".git"]}' \
    -- python -m rlactors run "$config" "$@"
