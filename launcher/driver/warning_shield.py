"""``python -m launcher.driver.warning_shield CMD ARGS...``: run CMD with SIGUSR2 ignored.

Slurm's warning before the time limit (SIGUSR2) is meant for the driver, which tears the job down in
order. If it reaches a Ray node's step as well (submitit's ``--signal=USR2@90`` signals every step), a
``ray start`` whose default action for SIGUSR2 is to die took its node down 90 s before the limit, and
the fleet with it. An ignored disposition survives ``exec`` and is inherited by every child (raylet,
workers), which is why this is a wrapper and not a handler.
"""

from __future__ import annotations

import os
import signal
import sys


def shielded(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "launcher.driver.warning_shield", *argv]


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m launcher.driver.warning_shield CMD [ARGS...]")
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    os.execvp(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
