"""Another user's process trying to take a port (the attack of ``test_port_hold``), runnable from a job's
training command too: this module imports nothing of the tests' own."""

from __future__ import annotations

import os
import subprocess
import textwrap

STRANGER_UID = 65534
SYSTEM_PYTHON = "/usr/bin/python3"  # the stranger cannot enter root's home, where the venv's python lives

# Binds host:port (and the wildcard) as fast as it can for argv[3] seconds; once bound, reports the
# first request that arrives and whether it carried Authorization.
STRANGER = textwrap.dedent(
    """\
    import json, socket, sys, time
    host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    out = {"attempts": 0, "bound": None, "got_authorization": False}
    end = time.monotonic() + seconds
    while time.monotonic() < end and out["bound"] is None:
        for addr in (host, "0.0.0.0"):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            out["attempts"] += 1
            try:
                s.bind((addr, port))
                s.listen()
            except OSError:
                s.close()
                continue
            out["bound"] = addr
            s.settimeout(max(0.1, end - time.monotonic()))
            try:
                conn, _ = s.accept()
                conn.settimeout(2)
                head = conn.recv(65536).decode("latin-1")
                out["got_authorization"] = "authorization:" in head.lower()
            except OSError:
                pass
            break
    print(json.dumps(out), flush=True)
    """
)


def stranger(host: str, port: int, seconds: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [SYSTEM_PYTHON, "-c", STRANGER, host, str(port), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        preexec_fn=lambda: os.setuid(STRANGER_UID),
    )
