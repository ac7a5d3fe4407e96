"""A second Unix user on this machine, for the tests of what another user of the cluster can plant.

The findings these tests cover (a planted fleet record, a checkpoint directory another user owns or can
write) are about file ownership, so the tests need a real second uid, not a chmod of the test's own
files. ``useradd`` needs root: CI runs as root (and so does the local Slurm cluster's login node, whose
``/etc/passwd`` is the machine's); elsewhere the test skips with the reason.

The user has no home and no login shell; it is made once per machine and left in place (a test run
that is killed must not leave a half-made user behind to trip the next one, and ``userdel`` of a
user whose files a concurrent test still holds fails anyway).
"""

from __future__ import annotations

import fcntl
import os
import pwd
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

NAME = "rlprobe"
LOCK = "/tmp/rl-launch-test-user.lock"  # serializes useradd between xdist lanes and concurrent runs


@dataclass(frozen=True)
class OtherUser:
    name: str
    uid: int
    gid: int

    def chown(self, *paths: Path) -> None:
        """Hand ``paths`` to this user, as if it had made them."""
        for p in paths:
            os.chown(p, self.uid, self.gid, follow_symlinks=False)

    def run(self, argv: list[str], timeout: float = 30.0, **kw: object) -> subprocess.CompletedProcess[str]:
        """``argv`` as this user (``runuser``), its output captured."""
        return subprocess.run(  # type: ignore[call-overload, no-any-return]
            ["runuser", "-u", self.name, "--", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **kw,
        )


def other_user() -> OtherUser:
    """The second user, made if it does not exist yet; skips the test where that needs root."""
    try:
        entry = pwd.getpwnam(NAME)
    except KeyError:
        if os.geteuid() != 0:
            pytest.skip(f"needs a second Unix user ({NAME}): run as root so the test can useradd it")
        # Two xdist lanes (or two runs) may get here at once; useradd takes /etc/passwd's own lock and fails
        # with "cannot lock" rather than waiting, so one lock file under /tmp makes them take turns.
        with open(LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                entry = pwd.getpwnam(NAME)
            except KeyError:
                made = subprocess.run(
                    ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", NAME],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if made.returncode not in (0, 9):  # 9: made meanwhile by a concurrent run
                    pytest.fail(f"useradd {NAME} failed: {made.stderr.strip()}")
                entry = pwd.getpwnam(NAME)
    if entry.pw_uid == os.geteuid():
        pytest.fail(f"{NAME} has this test's own uid {entry.pw_uid}")
    return OtherUser(NAME, entry.pw_uid, entry.pw_gid)
