"""Finding a job from what a person types: ``JOB`` is a Slurm job id (``123``), a job directory's name
(``grpo-123``) or its path, or a job's name (the spec's ``name``: ``grpo``, a standing fleet's name such as
``lora-fleet``), which names the newest job of that name; no ``JOB`` means the newest job under the job
root.

A name is matched last, after ids and directory names: a standing fleet is known to its users by its name
(``rl-launch status lora-fleet``, as docs/lora.md writes it), but its directory is
``lora-fleet-local-<time>-<pid>`` (or ``lora-fleet-<Slurm id>``), and matching directory names only made
``status`` answer "no job 'lora-fleet'" while the fleet served (``fleet grow``/``shrink`` had a fallback
of their own to the fleet record; ``status``, ``logs`` and ``cancel`` had none). The newest job of a name
is the one a name means: a fleet's name serves one fleet at a time, and an older job of the same name
stays reachable by its directory name or id.

One place for it, so ``list``, ``logs``, ``cancel``, ``status`` and every ``fleet`` command agree on which
job a word names and on what "newest" means (submission time, not the directory's mtime, which every
state update of a running job moves forward). Lookup failures are ``JobNotFound`` with a one-line message
saying where it looked and what to do; the CLI prints it as the command's error.

Only the caller's own job directories are found (``launcher.jobdir.ownership``): in a shared job root
another user can plant a directory whose state names a process of yours (``cancel`` SIGTERMs it) or a
Slurm id, and newer than your own it would have been "the newest job". Other users' directories are
skipped when scanning, and named (with their owner) when asked for; a root that others may rename
things in is refused whole.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

from launcher.jobdir.layout import JobDir
from launcher.jobdir.ownership import entry_problem, root_problem

DEFAULT_ROOT = "~/rl-launch/jobs"
"""The job root when none is given: the spec's default ``job_root`` (``launcher.spec.DEFAULT_JOB_ROOT``;
``tests/component/test_jobdir.py`` keeps the two equal). Expanded when used, not at import, so it follows
``$HOME``."""


class JobNotFound(LookupError):
    """No job answers to the given ``JOB`` (or there is no job at all) under the job root."""


class JobRefused(JobNotFound):
    """The job named (or the job root) is not the caller's to act on; a ``JobNotFound``, so every
    command that prints a failed lookup prints this one line too."""


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


def job_dirs(root: Path, skipped: list[tuple[Path, str]] | None = None) -> list[Path]:
    """Every job of the caller's under ``root``, oldest first. Entries that are not the caller's own
    directories (another user's, a symlink, writable by others) are left out, each added to ``skipped``
    with the reason when given. ``JobRefused`` for a root that is not safe to use."""
    if not root.is_dir():
        return []
    why = root_problem(root)
    if why is not None:
        raise JobRefused(why)
    dirs = []
    for p in root.iterdir():
        try:
            st = p.lstat()
        except OSError:
            continue
        if not (stat.S_ISLNK(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            continue
        problem = entry_problem(p, "directory", st)
        # another user's entry (its inside may be unreadable, and is untrusted); one of the caller's
        # own that is not a job (submitit's folder, a symlink) is no news
        foreign = st.st_uid != os.getuid()
        if problem is None and JobDir(p).exists():
            dirs.append(p)
        elif problem is not None and (foreign or JobDir(p).exists()) and skipped is not None:
            skipped.append((p, problem))
    return sorted(dirs, key=lambda p: (created_at(p), p.name))


_JOB_ID = re.compile(r"-(?:\d+|local-\d{8}-\d{6}-\d+)$")
"""The ``-<job id>`` every job directory's name ends in (``ResolvedSpec.job_dir``): a Slurm id, or
``local-<date>-<time>-<pid>`` for a local job or a local standing fleet."""


def _matches(d: Path, job: str) -> bool:
    return d.name == job or d.name.endswith(f"-{job}")


def job_name(d: Path) -> str | None:
    """The name the job was submitted under (the spec's ``name``): ``submitted.json``'s, else the
    directory's name without its job id (a local job has no ``submitted.json``); None when neither says."""
    submitted = JobDir(d).read_submitted()
    if submitted is not None and submitted.name:
        return submitted.name
    m = _JOB_ID.search(d.name)
    return d.name[: m.start()] if m else None


def find_job(job: str | None, root: Path) -> Path:
    """The named job's directory (by path, id, directory name, then job name: the newest of that name);
    the newest job under ``root`` when ``job`` is None. The one lookup of every command that takes a
    ``JOB``. Only the caller's own: a directory given by path, or a match by name, that is not is refused
    with its owner."""
    if job is None:
        dirs = job_dirs(root)
        if not dirs:
            raise JobNotFound(f"no jobs under {root} (pass --root, or a job id or directory)")
        return dirs[-1]
    path = Path(job)
    if path.is_dir():
        problem = entry_problem(path.resolve(), "job directory")
        if problem is not None:
            raise JobRefused(problem)
        return path
    skipped: list[tuple[Path, str]] = []
    dirs = list(reversed(job_dirs(root, skipped)))  # newest first
    for d in dirs:
        if _matches(d, job) or JobDir(d).slurm_job_id() == job:
            return d
    for d in dirs:
        if job_name(d) == job:
            return d
    for d, problem in skipped:
        if _matches(d, job) or d.name.startswith(f"{job}-"):
            raise JobRefused(f"job {job!r}: {problem}")
    raise JobNotFound(f"no job {job!r} under {root} (rl-launch list shows the jobs there)")
