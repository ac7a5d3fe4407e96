"""``rl-launch submit``: submit a job (Slurm) or run it here (``cluster: local``), and follow it.

* ``cluster: local`` runs the driver in the foreground on this machine (sim or CPU engines, Ray local,
  the router) and returns its exit code: the README's first command.
* ``cluster: slurm``, single allocation: submitit submits one job whose batch step runs the driver once
  on the first node (``slurm_use_srun=False``: the driver starts every other process itself, as srun
  steps, and must not be replicated per node). Hetjob layout: submitit has no heterogeneous jobs, so the
  rendered sbatch script is submitted with ``sbatch --parsable``.
* ``--in-allocation`` runs the driver inside an existing allocation (salloc, a user's own sbatch
  script, the rendered template).

Submission prints the job id and job directory and returns; ``--follow`` stays attached and shows the
phases from the job directory until the job ends, then exits with the job's exit code.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from launcher.driver.driver import Driver
from launcher.driver.jobdir import JobDir, write_json_atomic
from launcher.slurm import build_request, split_nodes
from launcher.spec import ResolvedSpec


class SubmitError(RuntimeError):
    """Slurm refused the job; the message carries Slurm's own words."""


def run_in_allocation(spec: ResolvedSpec, job_dir: Path | None = None) -> int:
    """The driver, inside an allocation (or on this machine for ``cluster: local``)."""
    if job_dir is None:
        job_id = os.environ.get("SLURM_JOB_ID") or f"local-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        job_dir = spec.job_dir(job_id)
    nodes = split_nodes(spec)
    return Driver(spec, job_dir, list(nodes.training), list(nodes.generation)).run()


def _driver_entry(spec_path: str) -> int:
    """What the submitit job runs (a module-level function, so it unpickles on the node)."""
    from launcher.spec import load_resolved

    spec = load_resolved(spec_path)
    code = run_in_allocation(spec)
    if code != 0:
        result = JobDir(spec.job_dir(os.environ["SLURM_JOB_ID"])).result_file
        reason = json.loads(result.read_text()).get("reason", "") if result.exists() else ""
        raise SystemExit(f"rl-launch job failed (exit {code}): {reason}")
    return code


def submit_slurm(spec: ResolvedSpec) -> tuple[str, Path]:
    """Submit; return (job id, job directory). Nothing is left queued if submission fails."""
    if spec.spec_path is None:
        raise SubmitError("the spec must come from a file to be submitted (the job re-reads it on the node)")
    request = build_request(spec)
    Path(spec.job_root).mkdir(parents=True, exist_ok=True)
    if request.submitit_parameters is not None:
        import submitit

        executor = submitit.AutoExecutor(folder=Path(spec.job_root) / "submitit" / "%j", cluster="slurm")
        params = dict(request.submitit_parameters)
        params["slurm_use_srun"] = False
        executor.update_parameters(**params)
        executor.update_parameters(slurm_setup=request.submitit_setup_for(executor))
        try:
            job = executor.submit(_driver_entry, spec.spec_path)
        except subprocess.CalledProcessError as exc:
            raise SubmitError(f"sbatch refused the job: {_stderr(exc)}") from None
        except Exception as exc:  # submitit wraps sbatch's failure in its own errors
            raise SubmitError(f"sbatch refused the job: {exc}") from None
        job_id = str(job.job_id)
    else:
        from launcher.render import write_sbatch

        script = write_sbatch(spec)
        proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SubmitError(f"sbatch refused the job: {proc.stderr.strip() or proc.stdout.strip()}")
        job_id = proc.stdout.strip().split(";")[0].split("+")[0]
    return job_id, spec.job_dir(job_id)


def _stderr(exc: subprocess.CalledProcessError) -> str:
    out = exc.stderr or exc.output or b""
    return (out.decode(errors="replace") if isinstance(out, bytes) else str(out)).strip()


def slurm_state(job_id: str) -> str:
    """The job's state from squeue (live) or sacct (finished); '' if Slurm does not know it (yet)."""
    q = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
    state = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else ""
    if state:
        return state
    a = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True, text=True
    )
    lines = [x.strip() for x in a.stdout.splitlines() if x.strip()]
    return lines[0].split()[0] if lines else ""


FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}


def follow_job(job_id: str, job_dir: Path, poll_s: float = 1.0, timeout_s: float | None = None) -> int:
    """Print each phase as the driver records it, until Slurm says the job ended; return its exit code."""
    from rich.console import Console

    console = Console(stderr=True)
    job = JobDir(job_dir)
    seen = 0
    start = time.monotonic()
    state = ""
    with console.status(f"job {job_id}: queued") as status:
        while True:
            state = slurm_state(job_id)
            events = job.read_events()
            for ev in events[seen:]:
                console.print(f"[bold]{ev['phase']}[/bold] {ev.get('detail', '')}")
            seen = len(events)
            status.update(
                f"job {job_id}: {state or 'submitted'}; phase {events[-1]['phase'] if events else '-'}"
            )
            if state.split()[0] in FINAL_STATES if state else False:
                break
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                console.print(f"[yellow]stopped following after {timeout_s:g} s; the job goes on[/yellow]")
                return 0
            time.sleep(poll_s)
    for ev in job.read_events()[seen:]:
        console.print(f"[bold]{ev['phase']}[/bold] {ev.get('detail', '')}")
    result = job.result_file
    code = (
        json.loads(result.read_text())["exit_code"] if result.exists() else (0 if state == "COMPLETED" else 1)
    )
    console.print(f"job {job_id} {state}: exit {code}")
    return int(code)


def submit_job(
    spec: ResolvedSpec,
    *,
    follow: bool = False,
    in_allocation: bool = False,
    job_dir: Path | None = None,
) -> int:
    """Submit ``spec`` (or run it in this allocation / locally); returns the exit status for the CLI."""
    if spec.cluster == "local" or in_allocation:
        return run_in_allocation(spec, job_dir)
    submitted = time.time()
    job_id, jdir = submit_slurm(spec)
    jdir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(jdir / "submitted.json", {"t": submitted, "job_id": job_id})
    print(f"submitted job {job_id}\njob directory: {jdir}", flush=True)
    if not follow:
        return 0
    return follow_job(job_id, jdir)
