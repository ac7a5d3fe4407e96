#!/usr/bin/env bash
# GPU smoke test of the dynamo.vllm path (not part of CI: CPU machines cannot run Dynamo's CUDA vLLM).
#
# Usage (on one GPU machine, from the repo root, with the project venv made and network for pip):
#   bench/dynamo_gpu_smoke.sh MODEL_DIR [ENGINES]
#
# Makes a venv with ai-dynamo[vllm] (the extra pins a CUDA vLLM), installs Debian's etcd and NATS if
# missing, and runs a local job: the runtime, ENGINES (default 1) `python -m dynamo.vllm` workers with
# --enable-rl, the frontend with the KV router, a request through it (with the job's key, read by curl from
# stdin: never in its argv) and `rl-launch fleet reset-cache`
# (each worker's /engine/flush_cache). Exits non-zero when any part fails; prints the job directory.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:?usage: bench/dynamo_gpu_smoke.sh MODEL_DIR [ENGINES]}"
engines="${2:-1}"
venv="${DYNAMO_GPU_VENV:-$PWD/.venv-dynamo-gpu}"
version="${DYNAMO_VERSION:-1.6.1}"

if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
fi
"$venv/bin/pip" install -q "ai-dynamo[vllm]==$version" "ai-dynamo-runtime==$version"
command -v etcd >/dev/null && command -v nats-server >/dev/null ||
  { apt-get update -qq && apt-get install -y -q etcd-server nats-server; }
export RL_LAUNCH_DYNAMO_PYTHON="$venv/bin/python"

work="$(mktemp -d)"
cat >"$work/spec.yaml" <<YAML
name: dynamo-gpu-smoke
cluster: local
job_root: $work/jobs
training:
  command: >-
    printf 'header = "Authorization: Bearer %s"\\n' "\$RL_POLICY_API_KEY" | curl -K -
    -sf "\$RL_POLICY_BASE_URL/completions" -H 'Content-Type: application/json'
    -d '{"model": "smoke", "prompt": [1, 2, 3, 4], "max_tokens": 8}' &&
    .venv/bin/rl-launch fleet reset-cache "\$RL_JOB_DIR"
generation:
  engine: dynamo-vllm
  model: $model
  served_model_name: smoke
  engines_per_node: $engines
  startup_timeout_s: 900
router:
  kind: dynamo
  dynamo: {router_mode: kv, discovery: etcd}
YAML
.venv/bin/rl-launch submit "$work/spec.yaml"
echo "job directory: $(ls -d "$work"/jobs/*)"
