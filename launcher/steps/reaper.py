"""``python -m launcher.steps.reaper --parent PID --session SID --ticks T``: a session of processes ends
with the process that started it, however that process ends.

What it guards: a local-mode step (the Ray head's ``ray start --block``, an engine host, the training
command) runs in a session of its own, so the driver can stop all of it by process group. The same
session is what outlives a driver that dies without its teardown (SIGKILL, the OOM killer): measured on a
local job whose driver was SIGKILLed, the Ray head and its 9 processes (gcs_server, raylet, the dashboard
and runtime-env agents, the client server, idle workers), the engine host with its simulated engines and
the training command were all still running 20 s later, and 13 minutes later in the standing-fleet test.

Why a process of its own, started by the driver (``guard``) in yet another session:

* ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, not the process: the driver
  starts engine hosts from the fleet controller's and the elastic fleet's threads, whose end would kill a
  healthy host. It also signals only the direct child, never the processes that child made.
* The step cannot watch the driver itself: ``ray start`` is Ray's code, and a step that is SIGKILLed or
  stuck could not act on what it saw.
* In its own session it survives what kills the driver's process group (``kill -9 -PGID``, a terminal's
  SIGINT or SIGHUP) and never receives the signals the driver sends the step's group.

How it knows the driver is gone: its parent changes (the kernel reparents it the moment the driver
exits, zombie or not), checked every ``POLL_S``. How it knows the step's session is still the one it was
given: the leader's start time (a recycled pid is never taken for it), and, once the leader has exited,
the processes whose session id is the leader's pid (Linux hands out no pid still in use as a session
id, so while one such process exists the number cannot be a stranger's).

What it does then (``end_session``): SIGTERM to the leader's process group, the step's own orderly stop
(``ray start --block`` stops its node's processes on it, the engine host its engines, which sit in
sessions of their own), then after ``grace_s`` SIGKILL to everything left in the session, whichever
process group it moved to (Ray starts its workers each in a group of its own, inside the session). It
only ever signals that one session: never ``ray stop``, which ends every Ray on the machine, other
users' and other jobs' included.

It exits, doing nothing, when the session ends while the driver lives (the driver stopped the step).

The same watch ends a Ray Serve replica's engine with its replica (``launcher.gateways.ray_serve.reaper``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from launcher.jobdir.process import start_ticks, stat_fields

POLL_S = 0.25
"""How often the parent and the session are looked at: a driver's death is acted on within this."""
GRACE_S = 10.0
"""How long the step's own stop gets before SIGKILL (a Ray head stops in ~1 s, an engine host's vLLM
engines in a few)."""
KILL_ROUNDS_S = 5.0
"""How long SIGKILL is repeated while members remain (a process forking as it is killed)."""


def session_members(sid: int) -> list[int]:
    """The live (not zombie) processes of session ``sid``, leader included, never this process."""
    me = os.getpid()
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        fields = stat_fields(int(name))
        if fields is not None and len(fields) > 3 and fields[3] == str(sid) and fields[0] != "Z":
            members.append(int(name))
    return members


def _leader_state(leader: int, ticks: int | None) -> str:
    """``alive``, ``exited`` (no process has its pid now, or only its zombie) or ``stranger`` (the pid
    went to another process: the session is not ours to touch)."""
    fields = stat_fields(leader)
    if fields is None:
        return "exited"
    if ticks is not None and start_ticks(leader) != ticks:
        return "stranger"
    return "exited" if fields[0] == "Z" else "alive"


def session_left(leader: int, ticks: int | None) -> bool:
    """Whether anything of the session ``leader`` started is still running."""
    state = _leader_state(leader, ticks)
    if state == "stranger":
        return False
    return state == "alive" or bool(session_members(leader))


def _signal(pid: int, sig: int, group: bool = False) -> None:
    try:
        os.killpg(pid, sig) if group else os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def end_session(leader: int, ticks: int | None, grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM to the leader's group, ``grace_s`` for the session to stop, then SIGKILL to every process
    left in it; the pids that had to be SIGKILLed."""
    state = _leader_state(leader, ticks)
    if state == "stranger":
        return []
    if state == "alive":
        _signal(leader, signal.SIGTERM, group=True)
    else:  # the leader is gone already: what it left gets the same chance
        for pid in session_members(leader):
            _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while session_left(leader, ticks) and time.monotonic() < deadline:
        time.sleep(0.1)
    killed: list[int] = []
    deadline = time.monotonic() + KILL_ROUNDS_S
    while time.monotonic() < deadline:
        if _leader_state(leader, ticks) == "stranger":
            break
        left = session_members(leader)
        if not left:
            break
        _signal(leader, signal.SIGKILL, group=True)
        for pid in left:
            _signal(pid, signal.SIGKILL)
        killed += [p for p in left if p not in killed]
        time.sleep(0.1)
    return sorted(killed)


def watch(parent: int, leader: int, ticks: int | None, grace_s: float = GRACE_S) -> bool:
    """Wait while ``parent`` lives; then end the session. True if it had to (the parent went first)."""
    while os.getppid() == parent:
        if not session_left(leader, ticks):
            return False
        time.sleep(POLL_S)
    if not session_left(leader, ticks):
        return False
    print(
        f"[rl-launch reaper] pid {parent}, which started session {leader}, is gone: ending the session",
        file=sys.stderr,
        flush=True,
    )
    killed = end_session(leader, ticks, grace_s)
    if killed:
        print(f"[rl-launch reaper] SIGKILLed after {grace_s:g} s: {killed}", file=sys.stderr, flush=True)
    return True


def guard(
    proc: subprocess.Popen[bytes], log: Path | None = None, grace_s: float = GRACE_S
) -> subprocess.Popen[bytes]:
    """Start the reaper of ``proc``'s session; ``proc`` must have been started with
    ``start_new_session=True`` by this process (its pid is then its session's id). What the reaper says
    goes to ``log`` (the step's own log)."""
    argv = [
        sys.executable,
        "-m",
        "launcher.steps.reaper",
        "--parent",
        str(os.getpid()),
        "--session",
        str(proc.pid),
        "--grace",
        str(grace_s),
    ]
    ticks = start_ticks(proc.pid)
    if ticks is not None:
        argv += ["--ticks", str(ticks)]
    out = log.open("ab") if log is not None else None
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=out if out is not None else subprocess.DEVNULL,
            start_new_session=True,
        )
    finally:
        if out is not None:
            out.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="End a session when the process that started it is gone.")
    parser.add_argument("--parent", type=int, required=True, help="the pid whose end ends the session")
    parser.add_argument("--session", type=int, required=True, help="the session's id (its leader's pid)")
    parser.add_argument("--ticks", type=int, default=None, help="the leader's start time (/proc stat 22)")
    parser.add_argument("--grace", type=float, default=GRACE_S, help="seconds between SIGTERM and SIGKILL")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the driver's to handle
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal kills the driver: act on that
    watch(args.parent, args.session, args.ticks, args.grace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
