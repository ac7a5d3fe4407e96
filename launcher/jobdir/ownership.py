"""Who owns what the CLI acts on: the job root, ``fleets/``, fleet records and job directories.

A job root may be shared (a team scratch, mode 1777), and then other users can create names in it.
Every command that follows what it finds there (a fleet record, a job directory, the driver pid in its
state, the Slurm id in its submission record) would otherwise act for whoever planted it: another user's
``fleets/prod.json`` and job directory made the victim's ``rl-launch fleet down prod`` SIGTERM one of the
victim's own, unrelated processes (security review 2026-12, finding 6). So:

* what rl-launch creates (the job root, ``fleets/``, a job directory and any missing parent) is 0700,
  chmodded after ``mkdir``: ``mkdir``'s mode is cut by the umask (775 under umask 002) and ``parents=True``
  gives the parents no mode at all;
* an existing root that its group or everyone may write, without the sticky bit, is refused: anyone who
  can write it can rename the caller's own entries (a job directory renamed to another job's name), so
  nothing found there can be trusted. With the sticky bit (a team scratch) others can add names but not
  move or remove the caller's, and every entry acted on must then be the caller's;
* a root owned by another user (except root, who owns ``/scratch`` and its like) is refused: its owner
  can rename anything in it;
* an entry acted on (record, job directory) must be the caller's, not a symlink (``lstat``: a symlink
  in a shared root is its maker's entry, whatever it points at), and writable by no one else.

Nothing here checks the root's own parents: a root inside a directory another user controls can be
swapped whole. Keep job roots in your home or your own scratch directory.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path


class Untrusted(RuntimeError):
    """A path another user owns or may change; the message (one line) names it, its owner and what to do.

    Not an ``OSError``: the readers that catch those as "unreadable" must never swallow this refusal."""


def user_label(uid: int) -> str:
    """``user alice (uid 1001)``: the owner as a refusal names it."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = "?"
    return f"user {name} (uid {uid})"


def entry_problem(path: Path, what: str, st: os.stat_result | None = None) -> str | None:
    """Why the entry at ``path`` (``lstat``, not followed; or ``st`` when the caller has it from an open
    descriptor) may not be trusted: a symlink, another user's, or writable by group or others. None when
    it is the caller's own, or missing (the caller decides what a missing entry means)."""
    if st is None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
    if stat.S_ISLNK(st.st_mode):
        return f"{what} {path} is a symlink made by {user_label(st.st_uid)}: not followed"
    if st.st_uid != os.getuid():
        return f"{what} {path} belongs to {user_label(st.st_uid)}, not to you"
    if st.st_mode & 0o022:
        return f"{what} {path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}); chmod go-w {path}"
    return None


def root_problem(root: Path) -> str | None:
    """Why the job root ``root`` may not be trusted (see the module's rules); None when it is fine or
    missing. The root itself may be a symlink the caller made (``~/rl-launch/jobs`` -> scratch): it is
    followed, and its target judged."""
    try:
        st = os.stat(root)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"job root {root}: {exc.strerror}"
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in (os.getuid(), 0):
        return (
            f"job root {root} belongs to {user_label(st.st_uid)}, who can rename anything in it: refused; "
            "use a job root of your own (--root, job_root)"
        )
    if mode & 0o022 and not mode & stat.S_ISVTX:
        return (
            f"job root {root} is writable by others without the sticky bit (mode {mode:04o}), so they can "
            f"rename your jobs and records there: refused; chmod 700 {root} (or chmod +t {root} for a team "
            "scratch)"
        )
    return None


def check_root(root: Path) -> None:
    """Raise ``Untrusted`` with ``root_problem``'s reason."""
    why = root_problem(root)
    if why is not None:
        raise Untrusted(why)


def make_private(path: str | Path) -> Path:
    """``path`` and every missing parent, each made 0700 (chmodded after ``mkdir``, whatever the umask).

    A directory that already exists keeps its mode, and so does one another process made meanwhile
    (it is not this call's to change: a team scratch's 1777 must stay). Returns ``path``."""
    path = Path(path).expanduser()
    missing = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            continue
        os.chmod(d, 0o700)
    return path


def ensure_job_root(root: str | Path) -> Path:
    """The job root, made 0700 when missing; ``Untrusted`` when it exists and is not safe to use."""
    path = Path(root).expanduser()
    check_root(path)
    make_private(path)
    check_root(path)  # made meanwhile by someone else: judged as found
    return path
