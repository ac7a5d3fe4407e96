"""``python -m launcher.steps.ray_node --job-dir DIR -- ray start ...``: one Ray node of a job, started on
its own node with SIGUSR2 ignored and Ray's files in a directory only the job's user can enter.

Why a private directory: without ``--temp-dir`` Ray writes its sessions, logs and Unix sockets under the
shared ``/tmp/ray``, and it makes that folder, every ``session_*`` and its ``logs/`` mode 0777 (it even
chmods a ``--temp-dir`` it is given to 0777). Any user of the node could then read the job's logs (engine
URLs, request ids, tracebacks) and plant files or sockets in the session. Here Ray's folder sits inside a
per-user parent made 0700 (``/tmp/rl-launch-<uid>``), so what Ray opens up inside stays closed to others.

The path is short on purpose: Ray's Unix sockets live at ``<temp>/session_<date>_<pid>/sockets/...``
and a socket path must stay under 108 bytes. It is derived from the job directory and this node's
hostname, so the nodes of a job never share one (on a cluster whose ``/tmp`` is shared, the local test
cluster among them, two nodes' raylet sockets would otherwise collide) and every node computes its own
without being told. It is kept after the job, as ``/tmp/ray`` was, for Ray's own logs; only its user reads
it.

Why SIGUSR2 is ignored: Slurm's warning before the time limit is meant for the driver, which tears the job
down in order. If it reaches a Ray node's step as well (submitit's ``--signal=USR2@90`` signals every step),
a ``ray start`` whose default action for SIGUSR2 is to die took its node down 90 s before the limit, and
the fleet with it. An ignored disposition survives ``exec`` and is inherited by every child (raylet,
workers), which is why it is set here, before Ray starts, and not in a handler.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import socket
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

PRIVATE_ROOT = "/tmp"
MAX_TEMP_DIR_CHARS = 40
"""Ray adds ~62 characters (``/session_<date>_<ms>_<pid>/sockets/plasma_store``) under 108."""


class PrivateDirError(RuntimeError):
    """The private parent exists but is not this user's 0700 directory (someone planted it)."""


def private_temp_dir(
    job_dir: str | os.PathLike[str], node: str | None = None, uid: int | None = None
) -> Path:
    """Ray's ``--temp-dir`` for this job on ``node`` (default: this host)."""
    uid = os.getuid() if uid is None else uid
    node = socket.gethostname() if node is None else node
    digest = hashlib.sha256(f"{os.path.abspath(job_dir)}\0{node}".encode()).hexdigest()[:10]
    path = Path(PRIVATE_ROOT) / f"rl-launch-{uid}" / digest
    if len(str(path)) > MAX_TEMP_DIR_CHARS:  # pragma: no cover - only with an enormous uid
        raise PrivateDirError(f"Ray's temp dir {path} is too long for its Unix socket paths")
    return path


def make_private(path: Path) -> Path:
    """Create ``path`` under a parent that is this user's and nobody else's (0700), or refuse.

    The parent is shared by the user's jobs and may exist: it is used only if it is a real directory (not
    a symlink) owned by this user; a group- or world-accessible mode is tightened. One made by another
    user is refused with the reason, never used (that user could read and write everything Ray puts in
    it)."""
    parent = path.parent
    try:
        os.mkdir(parent, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(parent)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        if stat.S_ISLNK(st.st_mode):
            what = "a symlink"
        elif not stat.S_ISDIR(st.st_mode):
            what = "not a directory"
        else:
            what = f"owned by uid {st.st_uid}"
        raise PrivateDirError(
            f"{parent} exists and is {what}, not this user's private directory; "
            "Ray's files cannot be kept private there: remove it (or ask an administrator to)"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(parent, 0o700)
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def node_command(job_dir: str | os.PathLike[str], ray_argv: Sequence[str]) -> list[str]:
    """The argv that starts ``ray_argv`` (``ray start ...``, no ``--temp-dir``) as a node of the job."""
    return [sys.executable, "-m", "launcher.steps.ray_node", "--job-dir", str(job_dir), "--", *ray_argv]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Start one Ray node of an rl-launch job (used by the driver)."
    )
    parser.add_argument("--job-dir", required=True, help="the job directory (names the private temp dir)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- ray start ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        temp_dir = make_private(private_temp_dir(args.job_dir))
    except (OSError, PrivateDirError) as exc:
        print(f"ray node on {socket.gethostname()}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(3) from None
    os.execvp(command[0], [*command, f"--temp-dir={temp_dir}"])


if __name__ == "__main__":
    main()
