"""``python -m launcher.driver.run_local JOB_DIR``: the detached driver of a local standing fleet.

``launcher.submit.fleet.fleet_up`` writes the job directory (the resolved spec snapshot and the
submitted record) and starts this in a session of its own; it runs exactly that snapshot, as a Slurm
job's driver does, until ``rl-launch fleet down``.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from launcher.driver.entry import run_in_allocation
    from launcher.jobdir import JobDir
    from launcher.spec.snapshot import read_spec

    job = JobDir(Path(argv[0]))
    return run_in_allocation(read_spec(job), job.path)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
