"""``rl-launch status [JOB]``: a live dashboard of one job (``--once``: one frame; ``--json``: the data).

Runs on the login node with nothing but the job directory and network access to the router and engines:
the same places ``rl-launch list``/``logs`` read, plus ``/metrics`` scrapes (the engines' with the job's
API key, the front's without; see ``launcher.status.collect`` for where each secret may go).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import click
from rich.console import Console, RenderableType
from rich.live import Live

from launcher.cli.options import lookup_target, root_option
from launcher.status.collect import StatusCollector, acollect_snapshot
from launcher.status.fit import fitted_frame
from launcher.status.render import render_snapshot


def live_frame(snap: dict, console: Console) -> RenderableType:
    """The live view's frame for the console's size: the engine table and the events keep their room
    (``launcher.status.fit``)."""
    return fitted_frame(snap, console.size.width, console.size.height)


async def _live(collector: StatusCollector, interval: float, console: Console) -> None:
    async with collector:
        with Live(console=console, auto_refresh=False, transient=False) as live:
            while True:
                started = time.monotonic()
                snap = await collector.collect()
                live.update(live_frame(snap, console), refresh=True)
                if snap["condition"] == "finished":
                    return  # the final frame stays on screen: result, last events
                await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))


@click.command("status")
@click.argument("job", required=False)
@click.option("--once", is_flag=True, help="Print one frame and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print the snapshot as JSON and exit (for scripts).")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=1.5,
    show_default=True,
    help="Seconds between frames; --once/--json measure rates over one interval.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0.05),
    default=1.0,
    show_default=True,
    help="Per-endpoint /metrics timeout; a slower endpoint is shown as unreachable.",
)
@click.option("--events", type=click.IntRange(min=0), default=8, show_default=True, help="Events shown.")
@root_option
def status_command(
    job: str | None, once: bool, as_json: bool, interval: float, timeout_s: float, events: int, root: Path
) -> None:
    """Show a job's fleet: router and per-engine load, latency, cache and health, and the last events.

    JOB is a Slurm job id, a job directory name or path, or a job's name (a standing fleet's among them: the
    newest job of that name); without it, the newest job under --root.
    """
    job_dir, queued_id = lookup_target(job, root)
    collector = StatusCollector(job_dir, slurm_job_id=queued_id, timeout_s=timeout_s, events=events)
    # rich reads COLUMNS; the stream it writes to decides (fd 1 may be a terminal where click's stream is not)
    console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 200)
    if as_json or once:
        snap = asyncio.run(acollect_snapshot(collector, interval))
        if as_json:
            click.echo(json.dumps(snap, indent=2, default=str))
        else:
            console.print(render_snapshot(snap, width=console.size.width))
        return
    try:
        asyncio.run(_live(collector, interval, console))
    except KeyboardInterrupt:
        pass
