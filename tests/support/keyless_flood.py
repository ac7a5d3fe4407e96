"""Another local user's keyless connection flood (issue 38, finding 4), for the test and the bench.

The flood runs as that user (``tests.support.other_user``) under the system's python, stdlib only, bounded
by its arguments: it opens connections that each ask ``GET /health`` (no key, kept alive), asks again on
every held one each round, reopens what it lost up to ``n`` held, and prints one JSON line per round
(``held``: the connections that answered the round's last ask).
"""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.support.other_user import OtherUser

FLOOD = r"""
import json, socket, sys, time
port, n, seconds, every = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
REQ = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"

def ask(s):
    s.sendall(REQ)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(4096)
        if not chunk:
            return False
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    while len(rest) < length:
        chunk = s.recv(4096)
        if not chunk:
            return False
        rest += chunk
    return head.startswith(b"HTTP/1.1 200")

def fresh():
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=2)
        s.settimeout(2)
        if ask(s):
            return s
        s.close()
    except OSError:
        pass
    return None

held, opened, t0 = [], 0, time.monotonic()
while time.monotonic() - t0 < seconds:
    kept = []
    for s in held:
        try:
            ok = ask(s)
        except OSError:
            ok = False
        if ok:
            kept.append(s)
        else:
            s.close()
    lost, held = len(held) - len(kept), kept
    for _ in range(n - len(held)):
        s = fresh()
        opened += 1
        if s is not None:
            held.append(s)
    alive = 0
    for s in held:
        try:
            alive += ask(s)
        except OSError:
            pass
    print(json.dumps({"t": round(time.monotonic() - t0, 2), "held": alive, "lost": lost, "opened": opened}),
          flush=True)
    time.sleep(every)
"""


def system_python() -> str:
    """A python the other user can run (the test's own may sit under root's 0700 home)."""
    for p in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(p, os.X_OK):
            return p
    pytest.skip("no system python3 the second user can run")


async def start_flood(
    user: OtherUser, port: int, n: int, seconds: float, every_s: float = 1.0, open_files: int = 0
) -> asyncio.subprocess.Process:
    """The flood against ``127.0.0.1:port`` as ``user``; ``open_files``: its soft open-file limit raised
    to this first (0: as it is), as a user does to hold more than ~1000 connections."""
    argv = [system_python(), "-c", FLOOD, str(port), str(n), str(seconds), str(every_s)]
    if open_files:
        argv = ["bash", "-c", f'ulimit -n {open_files} && exec "$@"', "flood", *argv]
    return await asyncio.create_subprocess_exec(
        "runuser",
        "-u",
        user.name,
        "--",
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
