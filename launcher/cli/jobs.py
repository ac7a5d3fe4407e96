"""``rl-launch list``, ``rl-launch cancel [JOB]``, ``rl-launch logs [JOB]``: the job directory plus Slurm.

A job is named by its Slurm job id (``123``), its directory name (``grpo-123``), its directory path or its
name (``grpo``, a standing fleet's name: the newest job of that name), found under ``--root`` by the lookup
every command shares (``launcher.cli.options``); ``logs`` (like ``status``) takes the newest job when none
is named. A Slurm job is known from the moment
``submit`` returns (its ``submitted.json``), queued or not. Everything shown comes from the job directory
(``launcher.jobdir``) and, for live state, from ``squeue``/``sacct`` (``launcher.slurm.queue``): nothing
else needs to be running for these commands to work.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import click

from launcher.cli.options import lookup_job, root_option
from launcher.jobdir import LOST, JobDir, NotTheDriver, driver_pid, lost_detail
from launcher.jobdir.lookup import JobNotFound, created_at, job_dirs


def slurm_job_id(job_dir: Path) -> str | None:
    return JobDir(job_dir).slurm_job_id()


def slurm_state(job_id: str) -> str:
    from launcher.slurm.queue import describe_state

    return describe_state(job_id)


def driver_gone(job: JobDir, slurm: str | None) -> str | None:
    """Why the job can no longer record a result (its driver was SIGKILLed, or the node went down):
    Slurm says it ended, or, for a local job on this host, its driver process is gone; None otherwise."""
    if slurm is not None:
        from launcher.slurm.queue import is_final

        return f"Slurm says {slurm}" if is_final(slurm) else None
    if job.driver_alive() is False:
        return f"its driver (pid {job.read_state().get('driver_pid')}) is gone"
    return None


def job_summary(d: Path) -> dict[str, Any]:
    """One job as ``list`` shows it (and ``list --json`` prints it)."""
    job = JobDir(d)
    state = job.read_state()
    result = job.read_result()
    job_id = slurm_job_id(d)
    slurm = slurm_state(job_id) if job_id else "local"
    phase = str(state.get("phase") or ("queued" if job_id else "-"))
    detail = str(result.reason if result is not None else state.get("detail") or "")
    if result is not None:
        phase = result.outcome or phase
    elif (why := driver_gone(job, slurm if job_id else None)) is not None:
        phase, detail = LOST, lost_detail(d.name, why, phase)
    submitted = job.read_submitted()
    return {
        **_fleet_columns(job, state, result is not None),
        "job": d.name,
        "job_id": job_id,
        "job_dir": str(d),
        "slurm": slurm,
        "phase": phase,
        "detail": detail,
        "front": state.get("front") or (submitted.front if submitted is not None else None),
        "engines": state.get("engines") or (submitted.engines if submitted is not None else None),
        "router_url": state.get("router_url"),
        "exit_code": result.exit_code if result is not None else None,
        "submitted": created_at(d),
        "updated": state.get("updated"),
    }


def _fleet_columns(job: JobDir, state: dict[str, Any], ended: bool) -> dict[str, Any]:
    """A standing fleet's name and its attached jobs, or the fleet a job is attached to."""
    record = state.get("fleet_record")
    if record:
        from launcher.fleet.standing import attached

        try:
            consumers = sorted(attached(job.path)) if not ended else []
        except Exception:  # a consumers file being rewritten: shown on the next list
            consumers = []
        return {"fleet": record.get("name"), "consumers": consumers, "attached_to": None}
    to = state.get("attached_to") or {}
    return {"fleet": None, "consumers": [], "attached_to": to.get("fleet")}


@click.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the jobs as a JSON list (for scripts).")
@root_option
def list_command(as_json: bool, root: Path) -> None:
    """The jobs under the job root, oldest first (queued ones included); standing fleets with the jobs
    attached to them. Fits the terminal (COLUMNS when piped; without it, a line a job) with every job
    id whole."""
    skipped: list[tuple[Path, str]] = []
    try:
        dirs = job_dirs(root, skipped)
    except JobNotFound as exc:  # a root others may rename things in
        raise click.ClickException(str(exc)) from None
    if skipped:  # on stderr: --json's stdout stays the list
        more = f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""
        click.echo(f"not listed, not yours to trust: {skipped[0][1]}{more}", err=True)
    rows = [job_summary(d) for d in dirs]
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    from rich.console import Console

    from launcher.cli.list_table import render_jobs, terminal_width

    width = terminal_width()
    # soft_wrap: the block is laid out for ``width`` already; rich must neither wrap nor crop an id
    Console(width=width or 10_000).print(render_jobs(rows, width), soft_wrap=True)


def _driver_process(job: JobDir) -> int:
    """The pid of a local job's driver, checked to be that job's driver (``driver_pid``: a recycled pid,
    or any process a state names, must not be signalled)."""
    try:
        return driver_pid(job.path, job.read_state())
    except NotTheDriver as exc:
        raise click.ClickException(str(exc)) from None


@click.command("cancel")
@click.argument("job")
@click.option(
    "--wait/--no-wait",
    default=True,
    show_default=True,
    help="Wait (up to --timeout) until the job has recorded its result.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    help="Seconds to wait for the job's result (with --wait), and for a gone driver's leftovers to end.",
)
@root_option
def cancel_command(job: str, wait: bool, timeout_s: float, root: Path) -> None:
    """Cancel a job, queued or running: scancel (the driver tears everything down on SIGTERM), or SIGTERM
    to a local job's driver."""
    from launcher.slurm.queue import cancel_own, is_final, job_state

    d = lookup_job(job, root)
    jd = JobDir(d)
    job_id = slurm_job_id(d)
    ended = jd.read_result()
    if ended is not None:  # what the user asked for holds: the job is not running (exit 0, as scancel's)
        click.echo(f"{d.name} has already ended ({ended.outcome}: {ended.reason}, exit {ended.exit_code})")
        return
    if job_id is not None:
        state = job_state(job_id)
        if is_final(state):  # Slurm ended it before its driver could record how: nothing is left to scancel
            _record_gone(jd, f"Slurm says {state}", [])
            return
        error = cancel_own(job_id)
        if error:
            raise click.ClickException(f"scancel {job_id} failed: {error}")
        click.echo(f"cancelled Slurm job {job_id} ({d})")
        done = lambda: jd.read_result() is not None or is_final(job_state(job_id))  # noqa: E731
    else:
        if jd.driver_alive() is False:
            _clean_up_after(jd, timeout_s)
            return
        pid = _driver_process(jd)
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:  # it died between the check and the signal
            _clean_up_after(jd, timeout_s)
            return
        click.echo(f"sent SIGTERM to the local driver {pid} ({d})")
        done = lambda: (r := jd.read_result()) is not None and r.torn_down  # noqa: E731
    if not wait:
        return
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise click.ClickException(f"{d.name} recorded no result within {timeout_s:g} s")
        time.sleep(0.2)
    result = jd.read_result()
    if result is not None:
        click.echo(f"{d.name}: {result.outcome}: {result.reason} (exit {result.exit_code})")


def _clean_up_after(jd: JobDir, timeout_s: float) -> None:
    """A local job whose driver is gone (SIGKILLed, the OOM killer) without its teardown: end what of the
    job still runs on this machine (``launcher.jobdir.leftovers``: its processes by their environment,
    SIGTERM then SIGKILL), then record it cancelled. Before, ``cancel`` answered "the driver ... is not
    running" (exit 1), and the state said ``training`` for good."""
    from launcher.jobdir import leftovers

    why = f"its driver (pid {jd.read_state().get('driver_pid')}) was gone"
    found, left = leftovers.end(jd.path, grace_s=min(leftovers.GRACE_S, timeout_s))
    if left:
        raise click.ClickException(
            f"{why}; {len(left)} process(es) of the job outlived SIGKILL: "
            + ", ".join(f"{p.pid} ({p.command[:60]})" for p in left[:5])
        )
    _record_gone(jd, why, [p.pid for p in found])


def _record_gone(jd: JobDir, why: str, ended: list[int]) -> None:
    """Record the job cancelled (``leftovers.record_cancelled``) and say what was done."""
    from launcher.jobdir import leftovers

    reason = leftovers.record_cancelled(jd, why, ended)
    click.echo(f"{jd.path.name}: cancelled: {reason}")
    if ended:
        click.echo(f"ended: {' '.join(map(str, ended))}")


def engine_log(d: Path, which: str) -> Path:
    """Engine ``which``'s log: its id as the dashboard shows it (``node0-1``) or its 0-based position in
    fleet order (node by node, in numeric node order)."""
    entries = JobDir(d).engine_entries()
    if not entries:
        raise click.ClickException(f"{d.name} lists no engines (yet)")
    ids = [e.id for e in entries]
    if which in ids:
        entry = entries[ids.index(which)]
    elif which.isdigit() and int(which) < len(entries):
        entry = entries[int(which)]
    else:
        raise click.ClickException(
            f"{d.name} has no engine {which!r}; --engine takes 0..{len(entries) - 1} or an id "
            f"({', '.join(ids[:4])}{', ...' if len(ids) > 4 else ''})"
        )
    return Path(entry.log) if entry.log else JobDir(d).engine_log(entry.node_index, entry.index)


def job_ended(d: Path) -> bool:
    """The driver recorded its result, or Slurm ended the job (killed before it could)."""
    jd = JobDir(d)
    if jd.read_result() is not None:
        return True
    job_id = slurm_job_id(d)
    if job_id is None:
        return False
    from launcher.slurm.queue import is_final, job_state

    return is_final(job_state(job_id))


@click.command("logs")
@click.argument("job", required=False)
@click.option(
    "--engine", "engine", default=None, help="An engine's log: its id (node0-1) or N (fleet order)."
)
@click.option("--training", "training", is_flag=True, help="The training command's output.")
@click.option("--router", "router", is_flag=True, help="The router's events (URL, policy, restarts).")
@click.option("--driver", "driver", is_flag=True, help="The driver's log (the default).")
@click.option("--follow", "-f", is_flag=True, help="Keep printing as the log grows; ends when the job ends.")
@root_option
def logs_command(
    job: str | None, engine: str | None, training: bool, router: bool, driver: bool, follow: bool, root: Path
) -> None:
    """Print a job's logs from its job directory (JOB: id, name or path; default: the newest job)."""
    if sum(bool(x) for x in (engine is not None, training, router, driver)) > 1:
        raise click.UsageError("--engine, --training, --router and --driver exclude each other")
    d = lookup_job(job, root)
    jd = JobDir(d)
    if router:
        for ev in jd.read_events():
            if "router" in ev.get("phase", "") or "router_url" in ev:
                click.echo(json.dumps(ev))
        return
    if engine is not None:
        path = engine_log(d, engine)
    elif training:
        path = jd.training_log
    else:
        path = jd.driver_log
    if not path.exists():
        if not follow:
            job_id = slurm_job_id(d)
            where = f" (Slurm: {slurm_state(job_id)})" if job_id and jd.read_state() == {} else ""
            raise click.ClickException(f"{path} does not exist (yet){where}")
        while not path.exists():
            if job_ended(d):
                raise click.ClickException(f"{d.name} ended without writing {path.name}")
            time.sleep(0.5)
    with path.open(errors="replace") as f:
        click.echo(f.read(), nl=False)
        checked = 0.0
        while follow:
            line = f.readline()
            if line:
                click.echo(line, nl=False)
                continue
            if time.monotonic() - checked > 2.0:
                checked = time.monotonic()
                if job_ended(d):
                    click.echo(f.read(), nl=False)  # what was written before the end
                    return
            time.sleep(0.3)
