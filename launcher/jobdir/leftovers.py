"""What a job whose driver is gone left running on this machine, and ending it (``rl-launch cancel``).

A driver that dies without its teardown (SIGKILL, the OOM killer) leaves its steps' sessions to their
reapers (``launcher.steps.reaper``), which end them within seconds. What no reaper ends: the sessions
whose reapers died too (the OOM killer picks several processes, a ``kill -9`` of a list of pids), and
anything a reaper is still stopping. Before, ``rl-launch cancel`` of such a job answered only "the driver
... is not running" (exit 1) and left all of it; now it ends what is left (``end``) and the job is
recorded as cancelled.

Which processes are the job's (``find``): the driver sets ``RL_LAUNCH_JOB_DIR`` to the job directory
before it starts anything, and every process it starts inherits it (the Ray head and its workers, the
engine hosts and engines, the reapers, the training command and its children); a process counts when it
runs as the caller (real and effective uid) and its environment names this job directory, or when it
sits in the session of such a process that leads its session (a step's session, whatever one of its
members did to its environment). Never by name or command line (another job's processes look the same),
never another user's, and never this command or its ancestors (a ``cancel`` run from the job's own
training command carries the variable too). Each is named by pid and start time, so a pid that is
recycled between the look and the signal is not signalled.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from launcher.jobdir.layout import JobDir, StateWriter
from launcher.jobdir.process import process_argv, process_uids, start_ticks, stat_fields
from launcher.jobdir.records import JobResult

JOB_DIR_ENV = "RL_LAUNCH_JOB_DIR"
"""Set by the driver (``launcher.driver.driver``) for every process of its job; the simulator's engines
read the same name (``launcher.engines.sim.process.JOB_DIR_ENV``)."""
GRACE_S = 10.0
"""How long SIGTERM gets before SIGKILL: the reaper's own grace (a Ray head stops in ~1 s, an engine host
its engines in a few)."""
KILL_ROUNDS_S = 5.0
"""How long SIGKILL is repeated while processes of the job remain (one forking as it is killed)."""


@dataclass(frozen=True)
class Leftover:
    pid: int
    ticks: int
    """Its start time (``start_ticks``): what is signalled is the process that was found."""
    command: str


def _names_job(pid: int, job: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    prefix = f"{JOB_DIR_ENV}=".encode()
    for entry in environ:
        if entry.startswith(prefix):
            value = entry[len(prefix) :].decode(errors="replace")
            return value == job or os.path.realpath(value) == job
    return False


def _ancestors() -> set[int]:
    """This process and its ancestors: never signalled, whatever their environment."""
    seen, pid = set(), os.getpid()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        fields = stat_fields(pid)
        pid = int(fields[1]) if fields else 0
    return seen


def find(job_dir: str | Path) -> list[Leftover]:
    """The caller's live processes on this machine that belong to job directory ``job_dir`` (see the
    module docstring), by pid."""
    job = os.path.realpath(job_dir)
    me, skip = os.getuid(), _ancestors()
    sessions: dict[int, int] = {}  # pid -> session id, of the caller's live processes
    marked: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        pid = int(name)
        fields = stat_fields(pid)
        if fields is None or len(fields) < 4 or fields[0] == "Z" or process_uids(pid) != (me, me):
            continue
        sessions[pid] = int(fields[3])
        if _names_job(pid, job):
            marked.add(pid)
    leaders = {pid for pid in marked if sessions[pid] == pid}
    pids = sorted(marked | {pid for pid, sid in sessions.items() if sid in leaders})
    found = []
    for pid in pids:
        ticks = start_ticks(pid)
        if ticks is not None:
            found.append(Leftover(pid, ticks, " ".join(process_argv(pid) or [])[:160]))
    return found


def _alive(p: Leftover) -> bool:
    fields = stat_fields(p.pid)
    return fields is not None and fields[0] != "Z" and start_ticks(p.pid) == p.ticks


def _signal(p: Leftover, sig: int) -> None:
    if _alive(p):
        try:
            os.kill(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def end(job_dir: str | Path, grace_s: float = GRACE_S) -> tuple[list[Leftover], list[Leftover]]:
    """SIGTERM to every process of the job (``find``), ``grace_s`` for them to stop (a Ray head stops its
    node, an engine host its engines), then SIGKILL to whatever of the job is left, looked up again (a
    process started meanwhile included). ``(found, still running)``: the second is empty unless a process
    outlived ``KILL_ROUNDS_S`` of SIGKILL (stuck in the kernel)."""
    found = find(job_dir)
    for p in found:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_alive(p) for p in found) and time.monotonic() < deadline:
        time.sleep(0.1)
    seen = {p.pid: p for p in found}
    deadline = time.monotonic() + KILL_ROUNDS_S
    while True:
        left = [p for p in {**seen, **{q.pid: q for q in find(job_dir)}}.values() if _alive(p)]
        seen.update((p.pid, p) for p in left)
        if not left or time.monotonic() > deadline:
            return sorted(seen.values(), key=lambda p: p.pid), left
        for p in left:
            _signal(p, signal.SIGKILL)
        time.sleep(0.1)


def record_cancelled(job: JobDir, why: str, ended: list[int], by: str = "rl-launch cancel") -> str:
    """Record a job that ended without its driver's word as cancelled (the state's phase, the event, the
    result), so ``list``, ``status``, a standing fleet's consumers and a second ``cancel`` all see it
    ended; returns the reason recorded. Only for a driver known to be gone: the driver is the one
    writer of the state while it lives."""
    last = str(job.read_state().get("phase") or "submitted")
    what = f"ended {len(ended)} process(es) it left" if ended else "nothing of it was running any more"
    reason = f"{why} without its teardown (last phase {last}); {by} {what}"
    StateWriter(job).event("cancelled", reason, outcome="cancelled", torn_down=True, left_pids=ended)
    job.write_result(JobResult(1, reason, "cancelled", None, {}, time.time(), torn_down=True))
    return reason
