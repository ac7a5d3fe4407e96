"""A replica's engine must not outlive the replica: ``python -m launcher.gateways.ray_serve.reaper
REPLICA_PID ENGINE_PGID`` waits for the replica process to go and then stops the engine's process group.

Why a separate process: the engine runs in its own session (so it can be stopped as a group), which
also means nothing kills it when its replica dies without running ``__del__`` (Serve force-kills a
replica that misses its graceful-shutdown timeout or is stuck in its constructor, ``ray.kill``, an OOM
kill). A vLLM engine left behind would hold its GPUs until the allocation ends.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie replica is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap(replica_pid: int, engine_pgid: int, poll_s: float = 0.5, grace_s: float = 5.0) -> None:
    while _alive(replica_pid) and _group_alive(engine_pgid):
        time.sleep(poll_s)
    if not _group_alive(engine_pgid):
        return
    try:
        os.killpg(engine_pgid, signal.SIGTERM)
        end = time.monotonic() + grace_s
        while _group_alive(engine_pgid) and time.monotonic() < end:
            time.sleep(0.1)
        os.killpg(engine_pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main() -> int:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # outlive the replica's own group being signalled
    reap(int(sys.argv[1]), int(sys.argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
