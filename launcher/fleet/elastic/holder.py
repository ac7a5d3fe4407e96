"""The grow job's one process: hold the allocation while the fleet's job lives, then end it.

The fleet's driver starts the engine hosts into this job (``srun --jobid``), so the holder starts nothing
itself. It ends (and Slurm with it ends every step on the grow's nodes) when:

* the driver asks: ``<job>/elastic/grow-<id>.release`` exists (a shrink that hands the nodes back);
* the fleet's job is no longer running (finished, cancelled, timed out, or its driver was killed and Slurm
  ended it): nothing of the grow may outlive it, whatever the driver could or could not do;
* the job directory's result says the job was torn down (a local driver, or one whose Slurm job is still
  ending);
* Slurm has not known the fleet's job for ``UNKNOWN_POLLS`` polls in a row: ``job_state`` is ``''`` when
  squeue no longer lists the job and sacct cannot say (no accounting, or the controller not answering),
  and a fleet job that is running is always in squeue. Without this, a fleet job whose driver was
  SIGKILLed (no result written) left the holder running to its own time limit;
* the fleet's ``state.json`` has not been written for ``STATE_STALE_S``: the driver's fleet controller
  rewrites it every tick (1 s) while the job runs, so a file that stopped changing means a driver that is
  gone or hung, whatever Slurm says. Changes are timed by this process's own clock (a new inode, mtime or
  size since the last poll), never by comparing the file's mtime with this node's time: the job
  directory is on a shared filesystem, whose clock may not be this node's;
* SIGTERM (``scancel``, the time limit).

Polled every few seconds: a grow's nodes stay allocated at most that long after the fleet is gone.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from launcher.jobdir.paths import grow_file
from launcher.slurm.queue import is_final, job_state

POLL_S = 3.0
UNKNOWN_POLLS = 40
"""Polls in a row (2 min) with Slurm not knowing the fleet's job before the grow ends: long enough for a
controller restart, short beside the hours a forgotten grow would otherwise hold its nodes."""
STATE_STALE_S = 300.0
"""How long ``state.json`` may go unwritten (normally every second) before the driver is taken for gone."""


def release_file(job_dir: Path, grow_id: str) -> Path:
    return grow_file(job_dir, grow_id, "release")


class FleetJobWatch:
    """What the holder remembers between polls: how long Slurm has not known the fleet's job, and when
    the job's ``state.json`` last changed."""

    def __init__(
        self,
        job_dir: Path,
        fleet_job: str,
        unknown_polls: int | None = None,
        stale_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state_file = job_dir / "state.json"
        self.fleet_job = fleet_job
        self.unknown_polls = UNKNOWN_POLLS if unknown_polls is None else unknown_polls
        self.stale_s = STATE_STALE_S if stale_s is None else stale_s
        self.clock = clock
        self.unknown = 0
        self._seen: tuple[int, int, int] | None = self._signature()
        self._changed_at = clock()

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = self.state_file.stat()
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def why_end(self, slurm_state: str) -> str | None:
        """Given this poll's ``job_state`` of the fleet's job: why the grow must end, or None."""
        self.unknown = self.unknown + 1 if not slurm_state else 0
        if self.unknown >= self.unknown_polls:
            return (
                f"Slurm has not known the fleet's job {self.fleet_job} for {self.unknown} polls in a row "
                "(neither squeue nor sacct lists it)"
            )
        now = self.clock()
        seen = self._signature()
        if seen != self._seen:
            self._seen, self._changed_at = seen, now
        elif now - self._changed_at >= self.stale_s:
            return (
                f"the fleet's {self.state_file.name} has not been written for {now - self._changed_at:.0f} s "
                "(its driver writes it every second): the driver is gone"
            )
        return None


def why_end(job_dir: Path, fleet_job: str, grow_id: str, watch: FleetJobWatch | None = None) -> str | None:
    """Why the grow must end now, or None while the fleet needs it. ``watch``: what earlier polls saw
    (without it, only this poll's evidence counts)."""
    if release_file(job_dir, grow_id).exists():
        return "released by the fleet's driver"
    try:
        result = json.loads((job_dir / "result.json").read_text())
        if result.get("torn_down"):
            return "the fleet's job was torn down"
    except (OSError, ValueError):
        pass
    state = job_state(fleet_job)
    if state and (
        is_final(state) or state.split()[0] not in ("RUNNING", "COMPLETING", "PENDING", "CONFIGURING")
    ):
        return f"the fleet's job {fleet_job} is {state}"
    return watch.why_end(state) if watch is not None else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job-dir", required=True, type=Path)
    parser.add_argument("--fleet-job", required=True)
    parser.add_argument("--grow", required=True)
    args = parser.parse_args(argv)

    stop = {"signal": None}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"holding grow {args.grow} for job {args.fleet_job} ({args.job_dir})", flush=True)
    watch = FleetJobWatch(args.job_dir, args.fleet_job)
    while stop["signal"] is None:
        why = why_end(args.job_dir, args.fleet_job, args.grow, watch)
        if why is not None:
            print(f"ending grow {args.grow}: {why}", flush=True)
            return 0
        time.sleep(POLL_S)
    print(f"ending grow {args.grow}: signal {stop['signal']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
