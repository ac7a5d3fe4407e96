"""The Slurm side of a resize: the grow job (its own allocation), its state, and handing nodes back.

Why a grow is its own job and not a bigger allocation: Slurm cannot add nodes to a running job in place
(``scontrol update`` only shrinks one; growing means a second job that is merged into it by hand, which
most sites forbid). A separate job keeps the site's accounting and limits, and queues like any other job,
so a busy partition makes a grow wait (its reason shown) instead of failing it. Its batch process is a
holder (``launcher.fleet.elastic.holder``) that keeps the allocation while the fleet's job lives; the fleet's
driver starts the engine hosts into it (``srun --jobid``), so they are the driver's steps like every other
(restarted, stopped, watched by the same code). The holder ends the grow job when the fleet's job is gone
however it ended, so a driver killed with SIGKILL leaves no allocation behind.

Handing back: a node of a grow job goes back by ending that job (``scancel``) or, when the job has other
nodes still serving, by shrinking it (``scontrol update JobId=.. NodeList=..``); a node of the fleet's
own allocation by shrinking the allocation the same way, which Slurm allows for a running job.
"""

from __future__ import annotations

import math
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from launcher.jobdir.paths import grow_file
from launcher.slurm.nodes import expand_hostlist, natural_key
from launcher.slurm.queue import job_end_time
from launcher.slurm.request import resource_directives
from launcher.slurm.srun import driver_launch_line
from launcher.spec import ResolvedSpec

_TIMEOUT_S = 15.0
MIN_GROW_S = 120
"""A grow needs this much of the fleet's time left: engines take a while to start, and a job shorter than
that would give back its nodes about when they start serving."""


class SlurmRefused(RuntimeError):
    """Slurm (or the partition's limits) refused the resize; the message is one line with the reason."""


def _run(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmRefused(f"{argv[0]} could not be run: {exc}") from None


def _words(proc: subprocess.CompletedProcess[str]) -> str:
    text = (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}").splitlines()
    return "; ".join(line.strip() for line in text if line.strip())[:300]


@dataclass(frozen=True)
class PartitionLimits:
    name: str
    total_nodes: int
    max_nodes: int | None
    """Per job (``MaxNodes``); None when UNLIMITED."""


def partition_limits(partition: str | None) -> PartitionLimits:
    """The partition's size and per-job node limit (``scontrol show partition``); the default partition
    when ``partition`` is None."""
    proc = _run(["scontrol", "show", "partition", "-o", *([partition] if partition else [])])
    if proc.returncode != 0:
        raise SlurmRefused(f"scontrol show partition {partition or ''}: {_words(proc)}".replace("  ", " "))
    for line in proc.stdout.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if partition is None and fields.get("Default") != "YES":
            continue
        if partition is not None and fields.get("PartitionName") != partition:
            continue
        maxn = fields.get("MaxNodes", "UNLIMITED")
        return PartitionLimits(
            fields.get("PartitionName", partition or "?"),
            int(fields.get("TotalNodes", "0") or 0),
            None if maxn in ("UNLIMITED", "") else int(maxn),
        )
    raise SlurmRefused(f"partition {partition or '(default)'} not found by scontrol show partition")


def check_grow_fits(spec: ResolvedSpec, nodes: int, held_in_partition: int) -> None:
    """Refuse a grow the partition can never run: more nodes than it has besides the job's own (the grow
    excludes the fleet's nodes), or than one job may have."""
    res = spec.generation.resources
    limits = partition_limits(res.partition if res is not None else None)
    if limits.max_nodes is not None and nodes > limits.max_nodes:
        raise SlurmRefused(
            f"partition {limits.name} allows at most {limits.max_nodes} node(s) per job; ask for fewer"
        )
    free = limits.total_nodes - held_in_partition
    if nodes > free:
        raise SlurmRefused(
            f"partition {limits.name} has {limits.total_nodes} node(s) and the job holds "
            f"{held_in_partition}: "
            f"a grow of {nodes} can never start (at most {max(free, 0)})"
        )


def grow_time_limit_s(fleet_job_id: str | None, wanted_s: float | None, now: float) -> int:
    """The grow job's time limit: what was asked, never past the fleet job's own end (Slurm's EndTime),
    in whole minutes, rounded down. A fleet job whose end Slurm does not give (squeue does not list it,
    or did not answer) is refused a grow: its limit would fall back to what was asked, and the grow could
    outlive the job by that much."""
    end = job_end_time(fleet_job_id) if fleet_job_id else None
    if fleet_job_id and end is None:
        raise SlurmRefused(
            f"Slurm gives no end time for the job ({fleet_job_id}: squeue does not list it or did not "
            "answer), and a grow must end with the job: try again once squeue lists it"
        )
    left = end - now if end is not None else None
    if left is not None and left < MIN_GROW_S:
        raise SlurmRefused(
            f"the job ends in {left:.0f} s: too soon for new engines to serve (needs {MIN_GROW_S} s)"
        )
    limit = min(x for x in (wanted_s, left) if x is not None) if (wanted_s or left) else None
    if limit is None:
        raise SlurmRefused("the job's end time is unknown to Slurm: give the grow a --time")
    return max(60, int(limit // 60) * 60)


def grow_script(
    spec: ResolvedSpec,
    job_dir: Path,
    grow_id: str,
    nodes: int,
    time_limit_s: int,
    exclude: list[str],
    fleet_job_id: str,
    srun_args: tuple[str, ...],
) -> str:
    """The grow job's batch script: the generation role's resources (partition, GPUs, account, QOS,
    extra ``#SBATCH`` lines) for ``nodes`` nodes, none of the fleet's own (``--exclude``), and the holder
    as its one process (in the spec's container when it has one, like the driver)."""
    res = spec.generation.resources
    slurm = spec.slurm
    assert res is not None and slurm is not None
    minutes = max(1, math.floor(time_limit_s / 60))
    log = job_dir / "logs" / f"grow-{grow_id}-%j.out"
    options = [
        f"--job-name={spec.name}-grow",
        f"--output={log}",
        "--open-mode=append",
        f"--time={minutes}",
        *([f"--account={slurm.account}"] if slurm.account else []),
        *resource_directives(res, nodes),
        *res.extra_sbatch,
    ]
    if exclude:
        options.append(f"--exclude={','.join(sorted(set(exclude), key=natural_key))}")
    holder = " ".join(
        shlex.quote(w)
        for w in (
            sys.executable,
            "-m",
            "launcher.fleet.elastic.holder",
            "--job-dir",
            str(job_dir),
            "--fleet-job",
            fleet_job_id,
            "--grow",
            grow_id,
        )
    )
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in options)]
    lines += [
        f"# rl-launch: generation nodes grown into job {fleet_job_id} ({job_dir.name}), grow {grow_id}",
        driver_launch_line(srun_args, holder),
        "",
    ]
    return "\n".join(lines)


def submit_grow(script: str, job_dir: Path, grow_id: str) -> str:
    """``sbatch`` the grow job; its id, or ``SlurmRefused`` with sbatch's words."""
    path = grow_file(job_dir, grow_id, "sbatch")
    path.write_text(script)
    path.chmod(0o600)
    proc = _run(["sbatch", "--parsable", str(path)])
    if proc.returncode != 0:
        raise SlurmRefused(f"sbatch refused the grow: {_words(proc)}")
    return proc.stdout.strip().split(";")[0]


@dataclass(frozen=True)
class GrowJobState:
    state: str
    """PENDING, RUNNING, ... or '' when the job is no longer in the queue."""
    reason: str
    nodes: tuple[str, ...]


def grow_job_state(job_id: str) -> GrowJobState | None:
    """The grow job in the queue now (``squeue``); ``GrowJobState('', ...)`` once it left the queue, None
    when squeue could not answer (no evidence: ask again)."""
    try:
        proc = _run(["squeue", "-h", "-j", job_id, "-o", "%T|%r|%N"])
    except SlurmRefused:
        return None
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            return GrowJobState("", "", ())
        return None
    for line in proc.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3:
            nodes = tuple(sorted(expand_hostlist(parts[2]), key=natural_key)) if parts[2] else ()
            return GrowJobState(parts[0], parts[1], nodes)
    return GrowJobState("", "", ())


def cancel_job(job_id: str) -> str | None:
    """``scancel``; None on success, else Slurm's words."""
    try:
        proc = _run(["scancel", job_id])
    except SlurmRefused as exc:
        return str(exc)
    return None if proc.returncode == 0 else _words(proc)


def shrink_job(job_id: str, keep: list[str], workdir: Path) -> str | None:
    """Shrink a running job to the nodes in ``keep`` (the others go back to Slurm now; the steps still on
    them are ended by Slurm). None on success, else Slurm's words.

    Run in ``workdir`` (the job's ``elastic`` directory): scontrol writes ``slurm_job_<id>_resize.sh`` and
    ``.csh`` (the new ``SLURM_*`` values) into its working directory, which would otherwise be wherever the
    user launched the job from."""
    nodelist = ",".join(sorted(keep, key=natural_key))
    try:
        proc = _run(["scontrol", "update", f"JobId={job_id}", f"NodeList={nodelist}"], cwd=workdir)
    except SlurmRefused as exc:
        return str(exc)
    return None if proc.returncode == 0 else _words(proc)
