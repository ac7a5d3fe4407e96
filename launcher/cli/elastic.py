"""``rl-launch fleet grow JOB --nodes N`` and ``rl-launch fleet shrink JOB --nodes N | --node NAME``:
resizing a running job's generation fleet (``launcher.fleet.elastic.client`` does the work; this parses and
prints). JOB is a job (id, directory name or path, or its name: a standing fleet's name among them),
found by the lookup every command shares (``launcher.jobdir.lookup``); only the caller's own: a grow or
shrink request written into a planted directory would wait on answers its owner writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from launcher.cli.options import lookup_job, root_option
from launcher.fleet.elastic import shapes

if TYPE_CHECKING:
    from launcher.fleet.elastic.client import ResizeResult


def _summary(elastic: dict[str, Any]) -> str:
    nodes = elastic.get("nodes", [])
    serving = [n["name"] for n in nodes if n["state"] == shapes.NODE_SERVING]
    draining = [n["name"] for n in nodes if n["state"] == shapes.NODE_DRAINING]
    ns = elastic.get("node_seconds") or {}
    line = f"serving on {len(serving)} node(s)"
    if draining:
        line += f", DRAINING {', '.join(draining)}"
    return line + f"; node-seconds held {ns.get('held', 0):.0f}, given back {ns.get('given_back', 0):.0f}"


def _print(result: ResizeResult, as_json: bool, wait: bool) -> None:
    if as_json:
        click.echo(json.dumps(result.elastic, indent=2))
        return
    click.echo(result.answer.message)
    if wait:
        click.echo(_summary(result.elastic))


_JSON = click.option("--json", "as_json", is_flag=True, help="Print the job's elastic state as JSON.")
_WAIT = click.option(
    "--wait/--no-wait", default=False, show_default=True, help="Return once it is done (else once accepted)."
)
_TIMEOUT = click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=1),
    default=1800.0,
    show_default=True,
    help="Seconds --wait waits.",
)


@click.command("grow")
@click.argument("job")
@click.option("--nodes", type=click.IntRange(min=1), default=None, help="Generation nodes to add.")
@click.option(
    "--time",
    "time_limit",
    default=None,
    help="The grow job's time limit (Slurm's format); never past the job's own end, which is the default.",
)
@click.option("--cancel", "cancel_id", default=None, metavar="GROW_ID", help="Cancel a grow still queued.")
@_WAIT
@_TIMEOUT
@_JSON
@root_option
def fleet_grow_command(
    job: str,
    nodes: int | None,
    time_limit: str | None,
    cancel_id: str | None,
    wait: bool,
    timeout_s: float,
    as_json: bool,
    root: Path,
) -> None:
    """Add generation nodes to a running job: a Slurm job of their own (the spec's resources, none of the
    job's nodes), whose engines join the fleet once healthy. A grow that queues says why; --cancel it."""
    from launcher.fleet.elastic.client import ElasticError, cancel, grow
    from launcher.slurm.time import parse_time

    jd = lookup_job(job, root)
    if (nodes is None) == (cancel_id is None):
        raise click.UsageError("give --nodes N (grow) or --cancel GROW_ID")
    try:
        if cancel_id is not None:
            result = cancel(jd, cancel_id, by="rl-launch fleet grow --cancel")
        else:
            limit = float(parse_time(time_limit)) if time_limit else None
            assert nodes is not None
            result = grow(jd, nodes, limit, wait=wait, timeout_s=timeout_s, by="rl-launch fleet grow")
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--time") from None
    except ElasticError as exc:
        raise click.ClickException(str(exc)) from None
    _print(result, as_json, wait)


@click.command("shrink")
@click.argument("job")
@click.option("--nodes", type=click.IntRange(min=1), default=None, help="How many nodes to give back.")
@click.option("--node", "names", multiple=True, help="A node to give back (repeatable).")
@click.option(
    "--drain-timeout",
    "drain_timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Seconds its requests in flight may take before they are aborted  "
    "[default: generation.drain_timeout_s]",
)
@_WAIT
@_TIMEOUT
@_JSON
@root_option
def fleet_shrink_command(
    job: str,
    nodes: int | None,
    names: tuple[str, ...],
    drain_timeout_s: float | None,
    wait: bool,
    timeout_s: float,
    as_json: bool,
    root: Path,
) -> None:
    """Drain generation nodes and give them back to Slurm: no new request goes to their engines, the ones
    in flight finish (at most the drain timeout), then the engines stop and the nodes are released."""
    from launcher.fleet.elastic.client import ElasticError, shrink

    jd = lookup_job(job, root)
    if (nodes is None) == (not names):
        raise click.UsageError("give --nodes N or --node NAME (repeatable)")
    try:
        result = shrink(
            jd,
            nodes or 0,
            list(names),
            drain_timeout_s,
            wait=wait,
            timeout_s=timeout_s,
            by="rl-launch fleet shrink",
        )
    except ElasticError as exc:
        raise click.ClickException(str(exc)) from None
    _print(result, as_json, wait)
