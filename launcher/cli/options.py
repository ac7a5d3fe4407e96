"""What the commands that look a job up share: ``--root`` and the ``JOB`` argument's lookup.

``list``, ``logs``, ``cancel``, ``status`` and every ``fleet`` command take the same ``--root`` and find
``JOB`` the same way (``find_target``: ``launcher.jobdir.lookup.find_job``, by path, Slurm id, directory
name or job name, then a standing fleet's record by name), so one word names one job everywhere. A lookup
that finds nothing is the command's one-line error (exit 1), never a traceback.
"""

from __future__ import annotations

from pathlib import Path

import click

from launcher.jobdir.lookup import DEFAULT_ROOT, JobNotFound, JobRefused, default_root, find_job


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
        return find_job_or_fleet(job, root)
    except JobNotFound as exc:
        raise click.ClickException(str(exc)) from None


def find_job_or_fleet(job: str | None, root: Path) -> Path:
    """``find_job``, then, for a word it does not know, the standing fleet of that name by its record
    (``launcher.fleet.standing.read_record``): the record says which job directory serves the name even
    where the directory's own records do not. A record that is not the caller's (a planted ``fleets/``,
    a record of another uid, a job directory of another user's) is refused naming it, as ``fleet down``
    refuses it. Here, not in ``launcher.jobdir`` (floor 1), because the record is the fleet wing's
    (floor 3)."""
    try:
        return find_job(job, root)
    except JobRefused:
        raise
    except JobNotFound:
        if job is None:
            raise
        from launcher.fleet.standing import FleetRefused, read_record

        try:
            record = read_record(root, job)
        except FleetRefused as refused:
            raise JobRefused(str(refused)) from None
        if record is None:
            raise
        return Path(record.job_dir)


def find_target(job: str | None, root: Path) -> tuple[Path | None, str | None]:
    """``(job dir, Slurm id)``: the named job, or the newest job directory when none is named.

    Here rather than in ``launcher.jobdir`` (floor 1), because it asks Slurm: the job directory's lookup
    knows only directories, and Slurm's helpers name the job directory's owner check, so the two
    packages each importing the other made a circle.

    A Slurm job that is still queued has no directory yet (the driver makes it on the allocation), so a
    bare job id that Slurm knows resolves to ``(None, id)`` and shows as queued instead of "no such job".
    """
    try:
        return find_job_or_fleet(job, root), None
    except JobRefused:
        raise
    except JobNotFound:
        from launcher.slurm import queue

        if job is not None and job.isdigit() and queue.describe_state(job) not in ("", "?"):
            return None, job
        raise


def lookup_target(job: str | None, root: Path) -> tuple[Path | None, str | None]:
    """Like ``lookup_job``, but a queued Slurm job without a directory yet is ``(None, its id)``."""
    try:
        return find_target(job, root)
    except JobNotFound as exc:
        raise click.ClickException(str(exc)) from None
