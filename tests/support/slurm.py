"""The local Slurm cluster (``slurm/cluster.sh``) as the tests that need it use it.

``slurm_cluster``: the module fixture (autouse where a module imports it) that skips the module without a
reachable cluster. ``node_namespace_processes``: every process in the cluster's node namespaces (each
test's leftover check and the root conftest's Slurm-queue hygiene). The rest: a sim job's spec
(``write_spec``), ``rl-launch submit`` and what it prints, the queue, and ``rl-launch`` itself (``run``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from tests.support.cli import RL_LAUNCH


def _slurm_unreachable() -> str | None:
    """Why Slurm cannot be used from this process, or None when ``sinfo`` answers."""
    if shutil.which("sinfo") is None:
        return "no sinfo on PATH (Slurm client not installed: slurm/cluster.sh install)"
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=8)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 8 s"
    if proc.returncode != 0:
        first = (proc.stderr.strip().splitlines() or ["?"])[0]
        return f"sinfo failed ({first})"
    if not proc.stdout.strip():
        return "sinfo shows no nodes"
    return None


class NodeProcess(NamedTuple):
    pid: int
    comm: str
    state: str
    """``/proc/PID/stat``'s state letter (``Z``: a zombie)."""
    cmdline: str


def node_namespace_processes() -> list[NodeProcess]:
    """Every process in the local cluster's node namespaces (``RL_SLURM_NODE_NETNS``); the login node
    sees them all. The one scan behind each test's leftover check and the Slurm-queue hygiene in
    conftest."""
    names = os.environ.get("RL_SLURM_NODE_NETNS", "").split()
    inodes = {os.stat(f"/run/netns/{n}").st_ino for n in names if os.path.exists(f"/run/netns/{n}")}
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino not in inodes:
                continue
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        found.append(NodeProcess(int(pid), comm, state, cmd))
    return found


# Processes that belong to a node itself, not to any job: its init shell, unshare and slurmd.
NODE_OWN = {"sh", "unshare", "slurmd"}


@pytest.fixture(scope="module", autouse=True)
def slurm_cluster() -> None:
    reason = _slurm_unreachable()
    if reason:
        pytest.skip(
            f"no Slurm cluster reachable: {reason} (slurm/cluster.sh start, then run on its login node)"
        )


def node_namespaces() -> list[str]:
    return os.environ.get("RL_SLURM_NODE_NETNS", "").split()


def leftovers() -> list[str]:
    """Processes in any node namespace other than the node's own (init, unshare, slurmd)."""
    assert any(os.path.exists(f"/run/netns/{n}") for n in node_namespaces()), (
        "RL_SLURM_NODE_NETNS names no node namespace (run via slurm/cluster.sh exec)"
    )
    return [
        f"{p.pid} {p.comm}: {p.cmdline[:160]}"
        for p in node_namespace_processes()
        if p.comm not in NODE_OWN and p.state != "Z"
    ]


def wait_no_leftovers(timeout_s: float = 20) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := leftovers()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def squeue_empty() -> bool:
    out = subprocess.run(["squeue", "-h"], capture_output=True, text=True, timeout=10).stdout
    return not out.strip()


FAULT_GENERATION = {
    "nodes": 2,
    "engine": "sim",
    "engines_per_node": 2,
    "served_model_name": "sim-8b",
    "startup_timeout_s": 60,
    "sim": {"speed": 3},
}
"""The fault jobs' generation: 2 nodes of 2 simulated engines, slow enough that a replay is still in
flight when the fault strikes."""


def write_spec(tmp_path: Path, name: str, command: str, **overrides: object) -> Path:
    spec = {
        "name": name,
        "cluster": "slurm",
        "job_root": str(tmp_path / "jobs"),
        "slurm": {"partition": "debug", "time": "00:20:00", "cpus_per_task": 2, "gpus_per_node": 0},
        "training": {"nodes": 1, "command": command},
        "generation": {
            "nodes": 2,
            "engine": "sim",
            "engines_per_node": 2,
            "served_model_name": "sim-8b",
            "startup_timeout_s": 60,
            "sim": {"speed": 20},
        },
        "router": {"policy": "cache_aware"},
    }
    spec.update(overrides)  # whole sections
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def submit(spec: Path, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [RL_LAUNCH, "submit", str(spec), *args], capture_output=True, text=True, timeout=timeout_s
    )


def job_dir_of(out: str) -> Path:
    line = next(x for x in out.splitlines() if x.startswith("job directory:"))
    return Path(line.split(":", 1)[1].strip())


def job_id_of(job: Path) -> str:
    return json.loads((job / "submitted.json").read_text())["job_id"]


SLURM = {"partition": "debug", "time": "00:20:00", "cpus_per_task": 2, "gpus_per_node": 0}


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RL_LAUNCH, *args], capture_output=True, text=True, timeout=timeout)
