"""The ``rl-launch`` command group. Subcommands live in their own modules and are registered here."""

from __future__ import annotations

import click

from launcher import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="rl-launch")
def main() -> None:
    """Launch RL post-training jobs: vLLM fleets behind one stable generation router."""


def _register() -> None:
    from router.cli import router_command

    main.add_command(router_command)

    from launcher.bench.cli import bench_group

    main.add_command(bench_group)

    from launcher.cli_spec import render_command, submit_command, validate_command

    main.add_command(validate_command)
    main.add_command(render_command)
    main.add_command(submit_command)

    from launcher.cli_jobs import cancel_command, list_command, logs_command

    main.add_command(list_command)
    main.add_command(cancel_command)
    main.add_command(logs_command)

    from launcher.status.cli import status_command

    main.add_command(status_command)


_register()
if __name__ == "__main__":
    main()
