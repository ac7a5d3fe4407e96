"""A replica's engine must not outlive the replica: ``python -m launcher.gateways.ray_serve.reaper
REPLICA_PID ENGINE_PGID`` waits for the replica process to go and then stops the engine's session.

Why a separate process: the engine runs in its own session (so it can be stopped as a group), which
also means nothing kills it when its replica dies without running ``__del__`` (Serve force-kills a
replica that misses its graceful-shutdown timeout or is stuck in its constructor, ``ray.kill``, an OOM
kill). A vLLM engine left behind would hold its GPUs until the allocation ends.

The watch and the stop are ``launcher.steps.reaper``'s, which ends a local job's steps with their driver the
same way: the replica started this process (its parent), the engine's pid is its session's id; SIGTERM
to the engine's group, SIGKILL after 5 s to whatever is left of its session.
"""

from __future__ import annotations

import signal
import sys

from launcher.jobdir import start_ticks
from launcher.steps.reaper import watch

GRACE_S = 5.0


def main() -> int:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # outlive the replica's own group being signalled
    replica, engine = int(sys.argv[1]), int(sys.argv[2])
    watch(replica, engine, start_ticks(engine), grace_s=GRACE_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
