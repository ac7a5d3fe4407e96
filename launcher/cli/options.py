"""What the commands that look a job up share: ``--root`` and the ``JOB`` argument's lookup.

``list``, ``logs``, ``cancel``, ``status`` and every ``fleet`` command take the same ``--root`` and find
``JOB`` the same way (``launcher.jobdir.lookup``), so one word names one job everywhere. A lookup that
finds nothing is the command's one-line error (exit 1), never a traceback.
"""

from __future__ import annotations

from pathlib import Path

import click

from launcher.jobdir.lookup import DEFAULT_ROOT, JobNotFound, default_root, find_job, find_target


def _root_or_default(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path:
    return value if value is not None else default_root()


root_option = click.option(
    "--root",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    callback=_root_or_default,
    help=f"The job root to look jobs up in: the spec's job_root.  [default: {DEFAULT_ROOT}]",
)
"""``--root``: read when the command runs (``~`` is expanded then, not at import), shown unexpanded."""


def lookup_job(job: str | None, root: Path) -> Path:
    """The directory of ``JOB`` (id, name or path; None: the newest job under ``root``)."""
    try:
        return find_job(job, root)
    except JobNotFound as exc:
        raise click.ClickException(str(exc)) from None


def lookup_target(job: str | None, root: Path) -> tuple[Path | None, str | None]:
    """Like ``lookup_job``, but a queued Slurm job without a directory yet is ``(None, its id)``."""
    try:
        return find_target(job, root)
    except JobNotFound as exc:
        raise click.ClickException(str(exc)) from None
