"""Finding a job from what a person types: ``JOB`` is a Slurm job id (``123``), a job directory's name
(``grpo-123``) or its path; no ``JOB`` means the newest job under the job root.

One place for it, so ``list``, ``logs``, ``cancel``, ``status`` and every ``fleet`` command agree on which
job a word names and on what "newest" means (submission time, not the directory's mtime, which every
state update of a running job moves forward). Lookup failures are ``JobNotFound`` with a one-line message
saying where it looked and what to do; the CLI prints it as the command's error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from launcher.jobdir.layout import JobDir

DEFAULT_ROOT = "~/rl-launch/jobs"
"""The job root when none is given: the spec's default ``job_root`` (``launcher.spec.DEFAULT_JOB_ROOT``;
``tests/test_jobdir.py`` keeps the two equal). Expanded when used, not at import, so it follows ``$HOME``."""


class JobNotFound(LookupError):
    """No job answers to the given ``JOB`` (or there is no job at all) under the job root."""


def default_root() -> Path:
    return Path(os.path.expanduser(DEFAULT_ROOT))


def created_at(d: Path) -> float:
    """When the job was submitted (or, for a local job, started): not the directory's mtime, which
    every state update of a running job moves forward."""
    job = JobDir(d)
    submitted = job.read_submitted()
    if submitted is not None and submitted.t:
        return submitted.t
    try:
        with job.events_file.open() as f:
            first = json.loads(f.readline())
        return float(first["t"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        return d.stat().st_mtime
    except OSError:
        return 0.0


def job_dirs(root: Path) -> list[Path]:
    """Every job under ``root``, oldest first."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and JobDir(p).exists()]
    return sorted(dirs, key=lambda p: (created_at(p), p.name))


def find_job(job: str | None, root: Path) -> Path:
    """The named job's directory; the newest job under ``root`` when ``job`` is None."""
    if job is None:
        dirs = job_dirs(root)
        if not dirs:
            raise JobNotFound(f"no jobs under {root} (pass --root, or a job id or directory)")
        return dirs[-1]
    path = Path(job)
    if path.is_dir():
        return path
    for d in reversed(job_dirs(root)):
        if d.name == job or d.name.endswith(f"-{job}") or JobDir(d).slurm_job_id() == job:
            return d
    raise JobNotFound(f"no job {job!r} under {root} (rl-launch list shows the jobs there)")


def find_target(job: str | None, root: Path) -> tuple[Path | None, str | None]:
    """``(job dir, Slurm id)``: the named job, or the newest job directory when none is named.

    A Slurm job that is still queued has no directory yet (the driver makes it on the allocation), so a
    bare job id that Slurm knows resolves to ``(None, id)`` and shows as queued instead of "no such job".
    """
    if job is None:
        return find_job(None, root), None
    try:
        return find_job(job, root), None
    except JobNotFound:
        from launcher.slurm import queue

        if job.isdigit() and queue.describe_state(job) not in ("", "?"):
            return None, job
        raise
