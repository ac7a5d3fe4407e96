"""A checkpoint swapped between the router's check and the engines' load (issue 38, finding 2).

The check read the victim's own files, then the engines loaded the path, resolving it again. Another
user who could rename an entry of any directory on the way (a team scratch it made, ``chmod 1777``; a
directory its group can write; the directory of a symlink the path goes through) swapped its own
checkpoint in the moment the check had read the weights (inotify, as ``rlprobe5`` did in the finding),
and every engine loaded and verified that user's weights under the trainer's version.

Here the attack is run for real: the second Unix user of ``tests/support/other_user.py`` runs the
watcher and the renames (``ATTACKER``) in its own process, with the kernel judging every access and
rename, in a directory other users can enter (``tests/support/shared_dir.py``: pytest's own temp
directory is private, so nothing in it can be attacked); the fleet is a real router over simulated
engines, whose load reads the path as vLLM's does.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.engines.sim.checkpoint import read_checkpoint
from router import GenerationRouter
from tests.support.checkpoints import checkpoint
from tests.support.http_backends import router_factory
from tests.support.other_user import OtherUser, other_user
from tests.support.refit_calls import TOKEN, admin, chat, send
from tests.support.shared_dir import shared_dir

__all__ = ["shared_dir"]  # the fixture

SYSTEM_PYTHON = "/usr/bin/python3"  # the other user cannot enter root's home, where the venv may live

# argv: the weights file the check reads, the directory the swap happens in, the victim's name there,
# the attacker's checkpoint's name there, "dir" (rename the victim's directory away and the attacker's
# into its place) or "link" (re-point the victim's symlink at the attacker's). Prints {"watching": uid}
# once watching (or {"error": ...}), then what happened; stops when its stdin closes.
ATTACKER = """\
import ctypes, json, os, select, sys, time
watched, where, victim, evil, mode = sys.argv[1:6]
libc = ctypes.CDLL(None, use_errno=True)
ino = libc.inotify_init1(os.O_NONBLOCK)
if libc.inotify_add_watch(ino, watched.encode(), 0x10) < 0:  # IN_CLOSE_NOWRITE: someone read it
    print(json.dumps({"error": os.strerror(ctypes.get_errno())}), flush=True)
    sys.exit()
print(json.dumps({"watching": os.getuid()}), flush=True)
ready, _, _ = select.select([ino, sys.stdin], [], [], 30)
if ino not in ready:
    print(json.dumps({"read": False}), flush=True)
    sys.exit()
t0 = time.perf_counter()
try:
    os.chdir(where)
    if mode == "dir":
        os.rename(victim, victim + ".orig")
        os.rename(evil, victim)
    else:
        os.symlink(os.path.join(where, evil), "next")
        os.rename("next", victim)
    print(json.dumps({"read": True, "swapped_ms": round((time.perf_counter() - t0) * 1000, 3)}), flush=True)
except OSError as exc:
    print(json.dumps({"read": True, "refused": str(exc)}), flush=True)
"""


@pytest.fixture
def router_over() -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(policy="round_robin", probe_interval_s=0, admin_token=TOKEN) as make:
        yield make


def scratch(shared: Path, probe: OtherUser, kind: str) -> Path:
    """The directory the victim's checkpoint (or its symlink) lies in, as each setup makes it."""
    d = shared / f"scratch-{kind}"
    if kind == "private-group":  # the same project directory, inside a 0700 directory of the fleet's user
        (shared / "private").mkdir(mode=0o700)
        d = shared / "private" / "project"
    d.mkdir()
    if kind in ("sticky", "link"):  # a team scratch the other user made, like /tmp
        probe.chown(d)
        d.chmod(0o1777)
    elif kind in ("group", "private-group"):  # a project directory the other user's group may write
        os.chown(d, 0, probe.gid)
        d.chmod(0o775)
    else:  # "root-sticky": a team scratch root (or the fleet's user) made: the safe kind
        d.chmod(0o1777)
    return d


class Attacker:
    def __init__(self, probe: OtherUser, watched: Path, where: Path, victim: str, evil: str, mode: str):
        self.proc = subprocess.Popen(
            [SYSTEM_PYTHON, "-c", ATTACKER, str(watched), str(where), victim, evil, mode],
            user=probe.uid,
            group=probe.gid,
            extra_groups=[],
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.first = json.loads(self.proc.stdout.readline())

    def outcome(self) -> dict[str, Any]:
        out, _ = self.proc.communicate(timeout=30)  # closes its stdin: one that saw no read stops
        lines = out.strip().splitlines()
        return json.loads(lines[-1]) if lines else self.first


REFUSED = ["sticky", "group", "link"]
"""A team scratch another user made (chmod 1777); a directory another user's group can write; a symlink
in another user's scratch that leads to the victim's own directory."""
SAFE = ["root-sticky", "private-group"]
"""A team scratch root made (chmod 1777): the kernel refuses the other user's renames there; a
group-writable directory inside a 0700 directory: the other user cannot even reach it."""


@pytest.mark.parametrize("kind", REFUSED + SAFE)
async def test_a_swap_after_the_check_never_reaches_the_engines(
    kind: str, sims, router_over, shared_dir: Path, tmp_path: Path
) -> None:
    probe = other_user()
    engines = await sims(2)
    url = router_over([e.url for e in engines]).base_url()
    base = checkpoint(tmp_path, "base", b"b")
    status, answer = await admin(url, "POST", "/fleet/refit", {"version": "v0", "from": str(base)})
    assert status == 200 and answer["ok"], answer
    d = scratch(shared_dir, probe, kind)
    evil = checkpoint(shared_dir, "evil", b"e")
    probe.chown(evil, evil / "config.json", evil / "model.safetensors")
    own = checkpoint(shared_dir if kind == "link" else d, "run1-ckpt", b"v")
    victims, theirs = read_checkpoint(str(own)), read_checkpoint(str(evil))  # read before the watch
    if kind != "private-group":
        evil = evil.rename(d / "evil")  # its own entry beside the victim's
    if kind == "link":
        (d / "latest").symlink_to(own)
        given, attacker = (
            d / "latest",
            Attacker(probe, own / "model.safetensors", d, "latest", "evil", "link"),
        )
    else:
        given, attacker = own, Attacker(probe, own / "model.safetensors", d, "run1-ckpt", "evil", "dir")
    status, answer = await admin(url, "POST", "/fleet/refit", {"version": "team-v1", "from": str(given)})
    attack = attacker.outcome()
    served = {
        "victim's"
        if e.rl.worker.digest == victims
        else "other user's"
        if e.rl.worker.digest == theirs
        else "previous"
        for e in engines
    }
    seen = (status, sorted(served), attack, answer.get("error") or answer.get("checkpoint_check"))
    print(json.dumps({kind: seen}))
    if kind in SAFE:
        assert status == 200 and served == {"victim's"}, seen
        if kind == "root-sticky":  # the kernel refuses the attacker's rename, the refit goes on
            assert attack["read"] and "Operation not permitted" in attack["refused"], seen
        else:  # the attacker cannot even watch the file
            assert attack == {"error": "Permission denied"}, seen
    else:
        assert status == 400 and served == {"previous"}, seen
        why = answer["error"]
        assert f"lies under {d}" in why and '"allow_foreign_checkpoint": true' in why, why
        if kind == "group":
            assert f"which group {probe.name} (gid {probe.gid}) can write (mode 0775, no sticky bit)" in why
        else:
            assert f"owned by {probe.name} (uid {probe.uid})" in why, why
        assert attack == {"read": False}, seen  # refused before a byte of the weights was read
    for _ in range(4):
        assert (await send(url, chat()))[0] == 200
