"""The path check inside a container whose user namespace maps only its user (``router.fleet.trusted_path``).

enroot/pyxis (``slurm.container``) run every step, the router included, in a user namespace that maps
the user to itself and nothing else: the host's root, and every other host user, show as the overflow
uid 65534. Refusing every directory of an owner the namespace cannot name refused ``/`` itself, so no
checkpoint could be loaded in such a container; taking them all for root's would let another user's team
scratch through. The rule: such a directory counts as root's only when no one else can write it.

Run for real: the second Unix user (``tests/support/other_user.py``) enters a new user namespace with
``unshare --user --map-current-user`` (the map enroot makes) and runs the module there with the system
Python (the module reads only the standard library, so it is copied into a directory that user reaches).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import router.fleet.trusted_path
from tests.support.checkpoints import checkpoint
from tests.support.other_user import other_user
from tests.support.shared_dir import shared_dir

__all__ = ["shared_dir"]  # the fixture

PROBE = """\
import json, sys
sys.path.insert(0, sys.argv[1])
from trusted_path import UntrustedPath, resolve_trusted
out = {"uid_map": open("/proc/self/uid_map").read().split()}
for key, path in (("usr", "/usr/share"), ("tmp", sys.argv[2])):
    try:
        out[key] = resolve_trusted(path, "checkpoint directory " + path)
    except UntrustedPath as exc:
        out[key] = "refused: " + str(exc)
print(json.dumps(out))
"""


def test_in_a_user_namespace_the_hosts_root_counts_as_root_unless_others_can_write(shared_dir: Path) -> None:
    probe = other_user()
    module = shared_dir / "module"
    module.mkdir()
    shutil.copy(router.fleet.trusted_path.__file__, module / "trusted_path.py")
    (module / "trusted_path.py").chmod(0o644)
    mine = checkpoint(shared_dir, "in-container")
    probe.chown(mine, *mine.iterdir())
    argv = [
        "unshare",
        "--user",
        "--map-current-user",
        "/usr/bin/python3",
        "-c",
        PROBE,
        str(module),
        str(mine),
    ]
    done = probe.run(argv, cwd="/")
    if done.returncode != 0 and "unshare failed" in done.stderr:
        pytest.skip(f"user namespaces are not available here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["uid_map"] == [str(probe.uid), str(probe.uid), "1"], seen  # enroot's map
    assert seen["usr"] == "/usr/share", seen  # / and /usr show as uid 65534, writable by no one else
    why = seen["tmp"]  # /tmp (1777) shows as uid 65534 too: it may be anyone's team scratch
    assert why.startswith(f"refused: checkpoint directory {mine} lies under /tmp, which every user can"), why
    assert "whose owner this container's user namespace does not map (uid 65534" in why, why
