#!/usr/bin/env bash
# CI: the README's test command (.venv/bin/python -m pytest -q -rs) on the login node of a local multi-node
# Slurm cluster, so the tests marked `slurm` run against a real controller instead of skipping.
#
# Installs the Slurm packages (skipped when present), starts slurm/cluster.sh's cluster, runs pytest on
# its login node with the project venv, and always stops the cluster again, also when pytest fails or the
# script is interrupted. Exits with pytest's status. Root only (namespaces, daemons).
#
#   .ci/pytest-in-cluster.sh                 # the whole suite
#   .ci/pytest-in-cluster.sh -m slurm -x     # extra arguments go to pytest
#
# Knobs: the RL_SLURM_* variables of slurm/cluster.sh (nodes, CPUs, fake GPUs, proctrack...).
set -euo pipefail
cd "$(dirname "$0")/.."

[[ -x .venv/bin/python ]] || { echo "pytest-in-cluster: no .venv here (create it first, see .ci/run)" >&2; exit 2; }

# shellcheck disable=SC2317  # only reached through the traps below
stop_cluster() {
  local rc=$?
  trap - EXIT INT TERM
  echo "== slurm: stop"
  slurm/cluster.sh stop || { echo "pytest-in-cluster: stopping the cluster failed" >&2; ((rc)) || rc=1; }
  exit "$rc"
}

echo "== slurm: install"
slurm/cluster.sh install
echo "== slurm: start"
trap stop_cluster EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
t0=$SECONDS
slurm/cluster.sh start
echo "== slurm: cluster up in $((SECONDS - t0)) s; pytest on the login node"
rc=0
# In the background + wait, so that a TERM/INT runs the traps at once instead of after pytest; stopping
# the cluster then also ends pytest, which runs inside the cluster's login namespace.
slurm/cluster.sh exec .venv/bin/python -m pytest -q -rs "$@" &
wait $! || rc=$?
echo "== slurm: pytest exited $rc"
exit "$rc"
