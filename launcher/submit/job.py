"""``rl-launch submit``: submit a job (Slurm) or run it here (``cluster: local``), and follow it.

* ``cluster: local`` runs the driver in the foreground on this machine (sim or CPU engines, Ray local,
  the router) and returns its exit code: the README's first command.
* ``cluster: slurm``, single allocation: submitit submits one job whose batch step runs the driver once
  on the first node (``slurm_use_srun=False``: the driver starts every other process itself, as srun
  steps, and must not be replicated per node). Hetjob layout: submitit has no heterogeneous jobs, so the
  rendered sbatch script is submitted with ``sbatch --parsable``.
* ``--in-allocation`` runs the driver inside an existing allocation (salloc, a user's own sbatch
  script, the rendered template).

**What you submit is what runs.** The job is submitted held (``--hold``); its directory, the
``submitted.json`` record and the resolved spec snapshot are written; then it is released. The driver
runs that snapshot, never the YAML file, which the user may edit while the job waits in the queue. A
job whose records could not be written is cancelled, so nothing is left queued behind an error.

Submission prints the job id and job directory (``--json``: as JSON) and returns; ``--follow`` stays
attached and shows the phases from the job directory until the job ends, then exits with the job's
exit code.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from launcher.driver.entry import driver_entry, run_in_allocation
from launcher.jobdir import JobDir, SubmittedJob
from launcher.slurm import build_request
from launcher.slurm.queue import cancel as scancel
from launcher.slurm.queue import is_final, job_state
from launcher.spec import ResolvedSpec
from launcher.spec.snapshot import write_spec


class SubmitError(RuntimeError):
    """Slurm refused the job; the message carries Slurm's own words."""


def _submit_held(spec: ResolvedSpec) -> str:
    """Submit with ``--hold``; return the job id."""
    request = build_request(spec)
    if request.submitit_parameters is not None:
        import submitit

        executor = submitit.AutoExecutor(folder=Path(spec.job_root) / "submitit" / "%j", cluster="slurm")
        params = dict(request.submitit_parameters)
        params["slurm_use_srun"] = False
        extra = dict(params.get("slurm_additional_parameters") or {})
        params["slurm_additional_parameters"] = {**extra, "hold": True}
        # submitit's batch shell runs the driver as a child; a shell without a trap dies of scancel's
        # SIGTERM (or a B:USR2 warning) at once, and Slurm then kills the driver mid-teardown. With a
        # trap it waits for the driver (a trap's handler is reset in the child, which keeps its own).
        params["slurm_setup"] = ["trap 'true' TERM USR2", *(params.get("slurm_setup") or [])]
        executor.update_parameters(**params)
        executor.update_parameters(slurm_setup=request.submitit_setup_for(executor))
        try:
            job = executor.submit(driver_entry, spec.job_root, spec.name)
        except subprocess.CalledProcessError as exc:
            raise SubmitError(f"sbatch refused the job: {_stderr(exc)}") from None
        except Exception as exc:  # submitit wraps sbatch's failure in its own errors
            raise SubmitError(f"sbatch refused the job: {exc}") from None
        return str(job.job_id)
    from launcher.submit.render import write_sbatch

    script = write_sbatch(spec)
    try:
        proc = subprocess.run(["sbatch", "--parsable", "--hold", str(script)], capture_output=True, text=True)
    except OSError as exc:
        raise SubmitError(f"sbatch could not be run: {exc}") from None
    if proc.returncode != 0:
        raise SubmitError(f"sbatch refused the job: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip().split(";")[0].split("+")[0]


def submit_slurm(spec: ResolvedSpec) -> tuple[str, Path]:
    """Submit; return (job id, job directory). Nothing is left queued if submission fails."""
    from launcher.jobdir.ownership import Untrusted, ensure_job_root

    try:  # 0700 when made here; one others may rename things in is refused before anything is queued
        ensure_job_root(spec.job_root)
    except Untrusted as exc:
        raise SubmitError(str(exc)) from None
    submitted = time.time()
    job_id = _submit_held(spec)
    job = JobDir(spec.job_dir(job_id))
    try:
        job.create()
        write_spec(job, spec)
        job.write_submitted(
            SubmittedJob(
                job_id=job_id,
                name=spec.name,
                cluster="slurm",
                t=submitted,
                spec_snapshot=str(job.spec_file),
                job_dir=str(job.path),
                **spec.kind_labels(),
            )
        )
        job.log_event("submitted", f"Slurm job {job_id} submitted", slurm_job_id=job_id)
        proc = subprocess.run(["scontrol", "release", job_id], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SubmitError(f"scontrol release {job_id} failed: {proc.stderr.strip()}")
    except BaseException:
        scancel(job_id)
        raise
    return job_id, job.path


def _stderr(exc: subprocess.CalledProcessError) -> str:
    out = exc.stderr or exc.output or b""
    return (out.decode(errors="replace") if isinstance(out, bytes) else str(out)).strip()


def follow_job(job_id: str, job_dir: Path, poll_s: float = 1.0, timeout_s: float | None = None) -> int:
    """Print each phase as the driver records it, until Slurm says the job ended; return its exit code."""
    from rich.console import Console
    from rich.markup import escape

    # Whole lines (soft_wrap): piped into a log, rich wrapped an event at 80 columns, and a phase's detail
    # is printed as text, never read as markup (a "[node1]" in an error vanished).
    console = Console(stderr=True, soft_wrap=True)
    job = JobDir(job_dir)
    seen = 0
    start = time.monotonic()
    state = ""
    with console.status(f"job {job_id}: queued") as status:
        while True:
            state = job_state(job_id)
            events = job.read_events()
            for ev in events[seen:]:
                console.print(f"[bold]{ev['phase']}[/bold] {escape(str(ev.get('detail', '')))}")
            seen = len(events)
            status.update(
                f"job {job_id}: {state or 'submitted'}; phase {events[-1]['phase'] if events else '-'}"
            )
            if is_final(state):
                break
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                console.print(f"[yellow]stopped following after {timeout_s:g} s; the job goes on[/yellow]")
                return 0
            time.sleep(poll_s)
    for ev in job.read_events()[seen:]:
        console.print(f"[bold]{ev['phase']}[/bold] {escape(str(ev.get('detail', '')))}")
    result = job.read_result()
    code = result.exit_code if result is not None else (0 if state == "COMPLETED" else 1)
    console.print(f"job {job_id} {state}: exit {code}")
    return int(code)


def submit_job(
    spec: ResolvedSpec,
    *,
    follow: bool = False,
    in_allocation: bool = False,
    job_dir: Path | None = None,
    as_json: bool = False,
) -> int:
    """Submit ``spec`` (or run it in this allocation / locally); returns the exit status for the CLI."""
    if spec.cluster == "local" or in_allocation:
        return run_in_allocation(spec, job_dir)
    job_id, jdir = submit_slurm(spec)
    if as_json:
        payload: dict[str, Any] = {"job_id": job_id, "job_dir": str(jdir), "name": spec.name}
        print(json.dumps(payload), flush=True)
    else:
        print(f"submitted job {job_id}\njob directory: {jdir}", flush=True)
    if not follow:
        return 0
    sys.stdout.flush()
    return follow_job(job_id, jdir)
