"""The ``rl-launch`` root group. Each subcommand lives in its group's module and is loaded on demand.

Why lazy: ``rl-launch --help`` and ``rl-launch validate`` must not pay for aiohttp, Ray, numpy or the
router server (importing every subcommand took ~0.6 s before any work). Each command is named here with
the module that defines it and its one-line help (for the command list); the module is imported only
when that command runs or asks for its own ``--help``. ``tests/unit/test_spec.py`` checks that the help lines
here match the commands' own.
"""

from __future__ import annotations

import importlib

import click

from launcher import __version__

# name -> (module, attribute, short help shown by `rl-launch --help`)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "bench": (
        "launcher.cli.bench",
        "bench_group",
        "Benchmarks: replay an RL rollout step (Gym-like client) against engines and routers.",
    ),
    "cancel": (
        "launcher.cli.jobs",
        "cancel_command",
        "Cancel a job, queued or running: scancel (the driver tears everything down on SIGTERM), or SIGTERM "
        "to a local job's driver.",
    ),
    "check": (
        "launcher.cli.check",
        "check_command",
        "Check that a spec can run on this site, before the first allocation: one line per failure, with "
        "its fix.",
    ),
    "fleet": (
        "launcher.cli.fleet",
        "fleet_group",
        "Fleet-wide operations on a running job: pause/resume, abort, weight versions, checksums, step "
        "metrics, cache invalidation; resizing (grow, shrink); standing fleets (up, down).",
    ),
    "list": (
        "launcher.cli.jobs",
        "list_command",
        "The jobs under the job root, oldest first (queued ones included); standing fleets with the jobs "
        "attached to them.",
    ),
    "logs": (
        "launcher.cli.jobs",
        "logs_command",
        "Print a job's logs from its job directory (JOB: id, name or path; default: the newest job).",
    ),
    "render": (
        "launcher.cli.spec",
        "render_command",
        "Write the standalone sbatch script of a job spec (submit it with `sbatch FILE`).",
    ),
    # the router defines its own command (router/cli.py: it runs without the launcher); registered here
    "router": ("router.cli", "router_command", "Run the generation router in the foreground."),
    "status": (
        "launcher.cli.status",
        "status_command",
        "Show a job's fleet: router and per-engine load, latency, cache and health, and the last events.",
    ),
    "submit": (
        "launcher.cli.spec",
        "submit_command",
        "Submit a job spec to Slurm (or run it locally with cluster: local).",
    ),
    "validate": (
        "launcher.cli.spec",
        "validate_command",
        "Check a job spec; print OK and a summary, or every problem (exit status 2).",
    ),
}


def load_command(name: str) -> click.Command:
    module, attr, _ = COMMANDS[name]
    command = getattr(importlib.import_module(module), attr)
    assert isinstance(command, click.Command)
    return command


class LazyGroup(click.Group):
    """A group whose subcommands are imported when used; the command list uses ``COMMANDS``' help."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return load_command(cmd_name) if cmd_name in COMMANDS else None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        limit = formatter.width - 6 - max(len(name) for name in COMMANDS)
        rows = []
        for name in sorted(COMMANDS):
            rows.append((name, click.utils.make_default_short_help(COMMANDS[name][2], limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="rl-launch")
def main() -> None:
    """Launch RL post-training jobs: vLLM fleets behind one stable generation router."""
