"""The grow job's one process: hold the allocation while the fleet's job lives, then end it.

The fleet's driver starts the engine hosts into this job (``srun --jobid``), so the holder starts nothing
itself. It ends (and Slurm with it ends every step on the grow's nodes) when:

* the driver asks: ``<job>/elastic/grow-<id>.release`` exists (a shrink that hands the nodes back);
* the fleet's job is no longer running (finished, cancelled, timed out, or its driver was killed and Slurm
  ended it): nothing of the grow may outlive it, whatever the driver could or could not do;
* the job directory's result says the job was torn down (a local driver, or one whose Slurm job is still
  ending);
* SIGTERM (``scancel``, the time limit).

Polled every few seconds: a grow's nodes stay allocated at most that long after the fleet is gone.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from launcher.slurm.queue import is_final, job_state

POLL_S = 3.0


def release_file(job_dir: Path, grow_id: str) -> Path:
    return job_dir / "elastic" / f"grow-{grow_id}.release"


def why_end(job_dir: Path, fleet_job: str, grow_id: str) -> str | None:
    """Why the grow must end now, or None while the fleet needs it."""
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
    return None


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
    while stop["signal"] is None:
        why = why_end(args.job_dir, args.fleet_job, args.grow)
        if why is not None:
            print(f"ending grow {args.grow}: {why}", flush=True)
            return 0
        time.sleep(POLL_S)
    print(f"ending grow {args.grow}: signal {stop['signal']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
