"""``rl-launch fleet up SPEC`` and ``rl-launch fleet down NAME``: standing fleets from the command line
(``launcher.submit.fleet`` does the work; this only parses and prints)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from launcher.cli.options import root_option
from launcher.cli.spec import _SET_OPT, _SPEC_ARG, _load
from launcher.fleet.standing import FleetRefused


@click.command("up")
@_SPEC_ARG
@_SET_OPT
@click.option(
    "--wait/--no-wait",
    default=True,
    show_default=True,
    help="Return once the fleet serves (else as soon as it is submitted or started).",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=1),
    default=None,
    help="Seconds to wait for it to serve.  [default: generation.startup_timeout_s + 120]",
)
@click.option("--json", "as_json", is_flag=True, help="Print the fleet's record (and URL) as JSON.")
def fleet_up_command(
    spec: Path, overrides: tuple[str, ...], wait: bool, timeout_s: float | None, as_json: bool
) -> None:
    """Start a standing fleet (a spec with a fleet: section): engines, router and fleet controller, named,
    serving until `rl-launch fleet down NAME`, its time limit or a cancel."""
    from launcher.jobdir import JobDir
    from launcher.submit.fleet import fleet_up

    resolved = _load(spec, overrides)
    if resolved.role != "fleet":
        raise click.ClickException(
            f"{spec}: not a standing fleet spec; add a fleet: section (and no training:), or run the job "
            "with `rl-launch submit`"
        )
    wait_s = (timeout_s or resolved.generation.startup_timeout_s + 120) if wait else None
    say = (lambda _m: None) if as_json else (lambda m: click.echo(m, err=True))
    try:
        record = fleet_up(resolved, say, wait_s)
    except FleetRefused as exc:
        raise click.ClickException(str(exc)) from None
    state = JobDir(record.job_dir).read_state()
    url = state.get("router_url")
    if as_json:
        click.echo(json.dumps({**record.to_json(), "router_url": url}, indent=2))
    else:
        where = f"serving {url}/v1" if url else "starting"
        click.echo(f"fleet {record.name}: {where} (job directory {record.job_dir})")
        click.echo(
            f"attach a job with generation: {{fleet: {record.name}}} "
            f"or `rl-launch submit --fleet {record.name} SPEC`"
        )


@click.command("down")
@click.argument("name")
@click.option("--force", is_flag=True, help="Bring it down even with jobs attached (their requests fail).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=120.0, show_default=True)
@root_option
def fleet_down_command(name: str, force: bool, timeout_s: float, root: Path) -> None:
    """Bring a standing fleet down: refused while jobs are attached unless --force; nothing of it is left
    running on any node, nor in the queue."""
    from launcher.submit.fleet import fleet_down

    try:
        fleet_down(name, root, force=force, timeout_s=timeout_s, say=lambda m: click.echo(m, err=True))
    except FleetRefused as exc:
        raise click.ClickException(str(exc)) from None
