"""What Slurm says about a job now: ``squeue`` for queued and running jobs, ``sacct`` once they ended.

The one place the launcher asks Slurm about jobs (``submit --follow``, ``list``, ``status``, ``logs``,
``cancel``, the dashboard and the driver's own time-limit check). Every query is bounded in time and
answers "unknown" rather than raising when Slurm's tools are missing or slow: a status command that
crashes because the controller is busy helps nobody.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass

FINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
    }
)

_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class QueueEntry:
    """One job as ``squeue`` shows it: state (PENDING, RUNNING, ...), reason (``%r``: Resources,
    Priority, BeginTime, ... ``None`` while running) and end time (epoch seconds, None if unknown)."""

    job_id: str
    state: str
    reason: str
    end_time: float | None


def slurm_available() -> bool:
    return shutil.which("squeue") is not None


def _run(argv: list[str]) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _parse_time(text: str) -> float | None:
    try:
        return time.mktime(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:  # N/A, Unknown, NONE
        return None


def squeue_entry(job_id: str) -> QueueEntry | None:
    """The job in the queue now; None when it is not there (ended, never existed) or Slurm is absent.
    A heterogeneous job lists one line per component; the first one speaks for the job."""
    proc = _run(["squeue", "-h", "-j", str(job_id), "-o", "%i|%T|%r|%e"])
    if proc is None or proc.returncode != 0:
        return None
    for line in proc.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4:
            return QueueEntry(str(job_id), parts[1], parts[2], _parse_time(parts[3]))
    return None


def sacct_state(job_id: str) -> str:
    """The job's state from accounting (``CANCELLED by 1000`` keeps its detail); '' if unknown."""
    proc = _run(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "State"])
    if proc is None or proc.returncode != 0:
        return ""
    lines = [x.strip() for x in proc.stdout.splitlines() if x.strip()]
    return lines[0] if lines else ""


def job_state(job_id: str) -> str:
    """squeue's state while the job is queued or running, then sacct's; '' if Slurm does not know it."""
    entry = squeue_entry(job_id)
    if entry is not None:
        return entry.state
    return sacct_state(job_id)


def is_final(state: str) -> bool:
    return bool(state) and state.split()[0] in FINAL_STATES


def job_end_time(job_id: str) -> float | None:
    entry = squeue_entry(job_id)
    return entry.end_time if entry is not None else None


def cancel(job_id: str) -> str | None:
    """``scancel`` the job (queued or running); None on success, else Slurm's words."""
    proc = _run(["scancel", str(job_id)])
    if proc is None:
        return "scancel could not be run (is Slurm installed here?)"
    if proc.returncode != 0:
        return proc.stderr.strip() or proc.stdout.strip() or f"scancel exited with {proc.returncode}"
    return None


def owner_uid(job_id: str) -> int | None:
    """The uid Slurm lists job ``job_id`` under (``squeue %U``); None when it is not in the queue, or
    Slurm did not answer."""
    proc = _run(["squeue", "-h", "-j", str(job_id), "-o", "%U"])
    if proc is None or proc.returncode != 0:
        return None
    for line in proc.stdout.splitlines():
        if line.strip().isdigit():
            return int(line.strip())
    return None


def cancel_own(job_id: str) -> str | None:
    """``scancel`` the job only if Slurm lists it as the caller's; None on success, else why not.

    For a job id read from a file (a job directory's record, a fleet record): a record another user
    wrote could name any job, and a Slurm operator's (or root's) scancel would cancel it. A job Slurm
    no longer lists has nothing left to cancel, and one whose owner Slurm cannot tell is left alone."""
    uid = owner_uid(job_id)
    if uid is None:
        return f"Slurm does not list job {job_id} (ended, or the controller did not answer): not cancelled"
    if uid != os.getuid():
        from launcher.jobdir.ownership import user_label

        return f"Slurm job {job_id} belongs to {user_label(uid)}, not to you: not cancelled"
    return cancel(job_id)


def describe_state(job_id: str) -> str:
    """Slurm's word on the job for people: ``PENDING (Resources)`` while queued (squeue's ``%r``), then
    its state (``RUNNING``, ``CANCELLED by 1000``...); '?' without Slurm or when it does not know it."""
    if not slurm_available():
        return "?"
    entry = squeue_entry(job_id)
    if entry is not None:
        if entry.state == "PENDING" and entry.reason and entry.reason != "None":
            return f"PENDING ({entry.reason})"
        return entry.state
    return sacct_state(job_id) or "?"
