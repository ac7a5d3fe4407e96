"""``rl-launch list``, ``rl-launch cancel JOB``, ``rl-launch logs JOB``: the job directory plus Slurm.

A job is named by its Slurm job id (``123``), its directory name (``grpo-123``) or its directory path.
Everything shown comes from the job directory (written by the driver) and, for live state, from
``squeue``/``sacct``: nothing else needs to be running for these commands to work.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import click

from launcher.driver.jobdir import JobDir

DEFAULT_ROOT = Path(os.path.expanduser("~/rl-launch/jobs"))
_ROOT = click.option(
    "--root",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_ROOT,
    show_default=True,
    help="Job root (the spec's job_root).",
)


def job_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if (p / "events.jsonl").exists() or (p / "state.json").exists()]
    return sorted(dirs, key=lambda p: p.stat().st_mtime)


def resolve_job(job: str, root: Path) -> Path:
    path = Path(job)
    if path.is_dir():
        return path
    for d in reversed(job_dirs(root)):
        if d.name == job or d.name.endswith(f"-{job}"):
            return d
    raise click.ClickException(f"no job {job!r} under {root} (rl-launch list shows the jobs there)")


def slurm_job_id(job_dir: Path) -> str | None:
    """The Slurm job id of ``<name>-<id>``; local runs are named ``<name>-local-<time>-<pid>``."""
    if "-local-" in job_dir.name:
        return None
    suffix = job_dir.name.rsplit("-", 1)[-1]
    return suffix if suffix.isdigit() else None


def slurm_state(job_id: str) -> str:
    if shutil.which("squeue") is None:
        return "?"
    from launcher.submit import slurm_state as state

    return state(job_id) or "?"


@click.command("list")
@_ROOT
def list_command(root: Path) -> None:
    """The jobs under the job root, oldest first."""
    from rich.console import Console
    from rich.table import Table

    table = Table()
    for column in ("job", "slurm", "phase", "detail", "router", "updated"):
        table.add_column(column, no_wrap=column != "detail")
    for d in job_dirs(root):
        state = JobDir(d).read_state()
        job_id = slurm_job_id(d)
        updated = state.get("updated")
        table.add_row(
            d.name,
            slurm_state(job_id) if job_id else "local",
            str(state.get("phase", "-")),
            str(state.get("detail", ""))[:60],
            str(state.get("router_url", "")),
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(updated)) if updated else "-",
        )
    Console(width=None if os.isatty(1) else 200).print(table)


@click.command("cancel")
@click.argument("job")
@_ROOT
def cancel_command(job: str, root: Path) -> None:
    """Cancel a job: scancel (the driver tears everything down on SIGTERM), or SIGTERM a local driver."""
    d = resolve_job(job, root)
    job_id = slurm_job_id(d)
    if job_id is not None:
        proc = subprocess.run(["scancel", job_id], capture_output=True, text=True)
        if proc.returncode != 0:
            raise click.ClickException(f"scancel {job_id} failed: {proc.stderr.strip()}")
        click.echo(f"cancelled Slurm job {job_id} ({d})")
        return
    pid = JobDir(d).read_state().get("driver_pid")
    if not pid:
        raise click.ClickException(f"{d} records no driver process to signal")
    try:
        os.kill(int(pid), signal.SIGTERM)
    except ProcessLookupError:
        raise click.ClickException(f"the driver of {d} (pid {pid}) is not running") from None
    click.echo(f"sent SIGTERM to the local driver {pid} ({d})")


def engine_log(d: Path, index: int) -> Path:
    listed: list[str] = []
    for urls in sorted((d / "engines").glob("node-*.urls.json")):
        listed += [e.get("log", "") for e in json.loads(urls.read_text()).get("engines", [])]
    if not 0 <= index < len(listed):
        raise click.ClickException(
            f"{d.name} has {len(listed)} engine(s); --engine takes 0..{len(listed) - 1}"
        )
    return Path(listed[index])


@click.command("logs")
@click.argument("job")
@click.option("--engine", "engine", type=int, default=None, help="Engine N's log (0-based, fleet order).")
@click.option("--router", "router", is_flag=True, help="The router's events (URL, policy, restarts).")
@click.option("--driver", "driver", is_flag=True, help="The driver's log (the default).")
@click.option("--follow", "-f", is_flag=True, help="Keep printing as the log grows.")
@_ROOT
def logs_command(job: str, engine: int | None, router: bool, driver: bool, follow: bool, root: Path) -> None:
    """Print a job's logs from its job directory."""
    d = resolve_job(job, root)
    if router:
        for ev in JobDir(d).read_events():
            if "router" in ev.get("phase", "") or "router_url" in ev:
                click.echo(json.dumps(ev))
        return
    path = engine_log(d, engine) if engine is not None else d / "driver.log"
    if not path.exists():
        raise click.ClickException(f"{path} does not exist (yet)")
    with path.open(errors="replace") as f:
        click.echo(f.read(), nl=False)
        while follow:
            line = f.readline()
            if line:
                click.echo(line, nl=False)
            else:
                time.sleep(0.5)
