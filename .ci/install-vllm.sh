#!/usr/bin/env bash
# CI's vLLM venv: the CPU build that scripts/install-vllm.sh --cpu installs (the users' installer owns the
# pins and the steps), built once per key in the cache of .ci/lib.sh (outside the clone) and reused by
# later runs with the same key; VENV_DIR becomes a symlink to it.
#
# Usage: .ci/install-vllm.sh [VENV_DIR]        (default: .venv-vllm in the repo root)
#        export RL_LAUNCH_VLLM_PYTHON="$(.ci/install-vllm.sh)"
#
# Prints only the venv's python path on stdout (everything else goes to stderr), so CI can capture it.
# Env: PYTHON (base interpreter, default python3), VLLM_VERSION (scripts/install-vllm.sh's), and the
# cache's RL_LAUNCH_CI_CACHE, RL_LAUNCH_CI_CACHE_KEEP (see .ci/lib.sh).
#
# The key (lib.sh's ci_key) hashes the base python, the pins (the installer's --pins lines: every step it
# runs) and the text of "$0" and lib.sh. "$0" is set to .ci/install-vllm.key.txt: the text this script had
# while it ran the same steps itself, byte for byte, so the venvs CI built then (same pins, same steps) keep
# their key and are reused instead of rebuilt (~3.5 GB). Edit that file to force a rebuild.
set -euo pipefail
# shellcheck source=.ci/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
ci_init vllm

venv="${1:-$CI_REPO_ROOT/.venv-vllm}"
installer="$CI_REPO_ROOT/scripts/install-vllm.sh"
mapfile -t pins < <("$installer" --cpu --pins)
((${#pins[@]})) || { ci_log "$installer --cpu --pins printed nothing"; exit 1; }

ci_build() { "$installer" --cpu --prefix "${CI_PY%/bin/python}" --python "$CI_BASE_PYTHON" >/dev/null; }
ci_check() { "$installer" --cpu --prefix "${CI_PY%/bin/python}" --check >/dev/null; }

BASH_ARGV0="$CI_REPO_ROOT/.ci/install-vllm.key.txt"
ci_venv "$venv" "${pins[@]}"
echo "$CI_OUT_PY"
