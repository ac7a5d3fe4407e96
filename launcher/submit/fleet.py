"""Bringing a standing fleet up and down, and checking a job that attaches to one before it is submitted.

``fleet_up``: a ``fleet:`` spec becomes a job like any other (same driver, same job directory), but it
runs no training and outlives every job that attaches to it. On Slurm it is submitted as usual; locally
the driver is started detached (its own session, its output in the job's driver log), because a local
fleet that lived only as long as the terminal that started it would not be standing. Either way the name
is recorded at once (``launcher.fleet.standing``), so a second ``fleet up`` of the same name is refused
and a job can find a fleet that is still queued.

``fleet_down``: refused while jobs are attached (unless ``force``): their next request would fail. It
asks the driver to end cleanly (the ``down`` file), waits for its teardown, and only if the driver does
not finish in time escalates to ``scancel`` / SIGTERM, so nothing of the fleet is left on any node. It
acts only on what is the caller's: the record and its job directory (``standing.read_record``), a Slurm
job Slurm lists under the caller's uid, a pid that is provably the fleet's driver; in a shared job root
another user's planted record had it SIGTERM a process of the caller's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from launcher.fleet import standing
from launcher.fleet.standing import FleetRecord, FleetRefused
from launcher.jobdir import JobDir, NotTheDriver, SubmittedJob, driver_pid
from launcher.spec import ResolvedSpec
from launcher.spec.snapshot import write_spec


def fleet_up(spec: ResolvedSpec, say: Callable[[str], None], wait_s: float | None) -> FleetRecord:
    """Start the standing fleet ``spec`` describes; with ``wait_s``, return once it serves (or raise
    ``FleetRefused`` with its driver's reason)."""
    if spec.role != "fleet":
        raise FleetRefused(f"{spec.name}: not a standing fleet spec (it has no fleet: section)")
    existing = standing.read_record(spec.job_root, spec.name)
    if existing is not None:
        state, why = standing.liveness(existing)
        if state != "gone":
            raise FleetRefused(
                f"fleet {spec.name!r} is already {state} ({why}; job {existing.job_dir}); bring it down "
                f"first with `rl-launch fleet down {spec.name}`"
            )
    if spec.cluster == "slurm":
        from launcher.submit.job import submit_slurm

        job_id, job_dir = submit_slurm(spec)
        record = standing.new_record(spec.name, job_dir, "slurm", spec.generation.served_model_name, job_id)
        standing.write_record(spec.job_root, record)
        say(f"submitted standing fleet {spec.name!r}: Slurm job {job_id}, job directory {job_dir}")
    else:
        record = _start_local(spec, say)
    if wait_s is not None:
        standing.wait_serving(record, wait_s, say)
    return record


def _start_local(spec: ResolvedSpec, say: Callable[[str], None]) -> FleetRecord:
    job = JobDir(spec.job_dir(f"local-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")).create()
    write_spec(job, spec)
    job.write_submitted(
        SubmittedJob(
            job_id="",
            name=spec.name,
            cluster="local",
            t=time.time(),
            spec_snapshot=str(job.spec_file),
            job_dir=str(job.path),
            **spec.kind_labels(),
        )
    )
    record = standing.new_record(spec.name, job.path, "local", spec.generation.served_model_name, None)
    standing.write_record(spec.job_root, record)
    log = (job.logs / "fleet-up.log").open("ab")
    # Its own session: the terminal's Ctrl-C or hangup does not reach it; `fleet down` ends it.
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.driver.run_local", str(job.path)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=os.getcwd(),
    )
    log.close()
    say(f"started standing fleet {spec.name!r} (driver pid {proc.pid}), job directory {job.path}")
    return record


def fleet_down(
    name: str, job_root: str | Path, *, force: bool, timeout_s: float, say: Callable[[str], None]
) -> FleetRecord:
    record = standing.read_record(job_root, name)
    if record is None:
        known = ", ".join(r.name for r in standing.list_records(job_root)) or "none"
        raise FleetRefused(f"no standing fleet {name!r} under {job_root} (fleets there: {known})")
    state, why = standing.liveness(record)
    job = JobDir(record.job_dir)
    if state == "gone":
        if record.cluster == "local" and job.read_result() is None and job.driver_alive() is False:
            why = _clean_up_after(job)
        standing.remove_record(job_root, record)
        say(f"fleet {name!r} had already ended ({why}); its record is removed")
        return record
    standing.prune_ended(record.job_dir)
    consumers = standing.attached(record.job_dir)
    if consumers and not force:
        raise FleetRefused(
            f"fleet {name!r} has {len(consumers)} attached job(s): {', '.join(sorted(consumers))}; their "
            "requests would fail. Wait for them to end, or pass --force"
        )
    if state == "queued" and record.slurm_job_id:
        from launcher.slurm.queue import cancel_own

        error = cancel_own(record.slurm_job_id)
        if error:
            raise FleetRefused(f"scancel {record.slurm_job_id} failed: {error}")
        standing.remove_record(job_root, record)
        say(f"fleet {name!r} was still queued: Slurm job {record.slurm_job_id} cancelled")
        return record
    standing.request_down(job.path, force, "rl-launch fleet down" + (" --force" if force else ""))
    say(f"fleet {name!r}: asked its driver to bring it down")
    if not _wait_ended(record, timeout_s):
        say(f"fleet {name!r}: no teardown within {timeout_s:g} s; stopping its job")
        _stop_hard(record)
        if not _wait_ended(record, 60.0):
            raise FleetRefused(f"fleet {name!r} did not end; see rl-launch logs {record.job_dir}")
    standing.remove_record(job_root, record)
    result = job.read_result()
    say(f"fleet {name!r} is down" + (f": {result.reason}" if result is not None else ""))
    return record


def _clean_up_after(job: JobDir) -> str:
    """A local fleet whose driver is gone without its teardown (SIGKILLed with its reapers): end what of
    it still runs here and record it ended, as ``rl-launch cancel`` does (``launcher.jobdir.leftovers``);
    its engines and router would otherwise serve on, with no one to bring them down."""
    from launcher.jobdir import leftovers

    why = f"its driver (pid {job.read_state().get('driver_pid')}) was gone"
    found, left = leftovers.end(job.path)
    if left:
        pids = ", ".join(str(p.pid) for p in left[:5])
        raise FleetRefused(f"{why}; {len(left)} process(es) of the fleet outlived SIGKILL: {pids}")
    return leftovers.record_cancelled(job, why, [p.pid for p in found], by="rl-launch fleet down")


def _wait_ended(record: FleetRecord, timeout_s: float) -> bool:
    job = JobDir(record.job_dir)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = job.read_result()
        if result is not None and result.torn_down:
            if record.slurm_job_id:
                from launcher.slurm.queue import is_final, job_state

                if not is_final(job_state(record.slurm_job_id)) and time.monotonic() < deadline:
                    time.sleep(0.5)
                    continue
            return True
        if record.slurm_job_id is None and job.driver_alive() is False:
            return True
        time.sleep(0.3)
    return False


def _stop_hard(record: FleetRecord) -> None:
    """``scancel`` the fleet's Slurm job, or SIGTERM its local driver: only a job Slurm lists as the
    caller's, only a pid that is provably the fleet's driver (``launcher.jobdir.driver_pid``: a record
    is the caller's by now, but its state may name any process). ``FleetRefused`` when neither may be
    done, with the reason."""
    if record.slurm_job_id:
        from launcher.slurm.queue import cancel_own

        error = cancel_own(record.slurm_job_id)
        if error:
            raise FleetRefused(f"fleet {record.name!r} not stopped: {error}")
        return
    job = JobDir(record.job_dir)
    try:
        pid = driver_pid(job.path, job.read_state())
    except NotTheDriver as exc:
        raise FleetRefused(f"fleet {record.name!r} not stopped: {exc}") from None
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass  # it ended meanwhile


def check_attachable(spec: ResolvedSpec, say: Callable[[str], None]) -> FleetRecord:
    """Before a job on a standing fleet is submitted (or run here): the fleet exists, is this user's, on
    this cluster, serves the job's model, and is serving or (bounded) comes to serve. Nothing is
    allocated for a job that could not attach."""
    gen = spec.generation
    assert gen.fleet is not None
    record = standing.resolve_fleet(
        gen.fleet,
        spec.job_root,
        cluster=spec.cluster,
        model_name=spec.gym.model_name or gen.served_model_name or None,
    )
    standing.wait_serving(record, gen.fleet_wait_s, say)
    return record
