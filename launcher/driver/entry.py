"""The node side of a job: what ``rl-launch submit`` (local), submitit's batch step and a standing
fleet's detached driver run on the job's first node.

It sits in the driver's package, below the login side that calls it: ``launcher.submit.job`` pickles
``driver_entry`` by reference for submitit, so the function's module path is part of the submitted job
and must not move with the submission code.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from launcher.jobdir import JobDir
from launcher.slurm import split_nodes
from launcher.spec import ResolvedSpec
from launcher.spec.snapshot import read_spec


def run_in_allocation(spec: ResolvedSpec, job_dir: Path | None = None) -> int:
    """The driver, inside an allocation (or on this machine for ``cluster: local``). A job directory
    that holds a submitted snapshot runs that snapshot."""
    # Imported here: the driver pulls in Ray and every kind, and ``rl-launch submit`` imports this module
    # on the login node only to hand ``driver_entry`` to submitit.
    from launcher.driver.driver import Driver

    if job_dir is None:
        job_id = os.environ.get("SLURM_JOB_ID") or f"local-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        job_dir = spec.job_dir(job_id)
    job = JobDir(job_dir)
    if job.spec_file.exists() and job.submitted_file.exists():
        spec = read_spec(job)
    nodes = split_nodes(spec)
    return Driver(spec, job.path, list(nodes.training), list(nodes.generation)).run()


def driver_entry(job_root: str, name: str) -> int:
    """What the submitit job runs (a module-level function, so it unpickles on the node): the snapshot
    in ``<job_root>/<name>-<SLURM_JOB_ID>``, written before the job was released."""
    job = JobDir(Path(job_root) / f"{name}-{os.environ['SLURM_JOB_ID']}")
    spec = read_spec(job)
    code = run_in_allocation(spec, job.path)
    if code != 0:
        result = job.read_result()
        raise SystemExit(f"rl-launch job failed (exit {code}): {result.reason if result else ''}")
    return code
