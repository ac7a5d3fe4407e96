"""The Slurm client commands a launch path needs, checked before anything is submitted or started.

Why up front: without ``sbatch`` or ``srun`` on PATH, submitit fails deep inside its executor with a
~30-line traceback ("Could not detect srun") and the driver would fail at its first step; one line that
names the missing command and the fix is what a user can act on.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable


class SlurmCommandMissing(RuntimeError):
    """A Slurm client command is not on PATH; ``str()`` is one line naming it and what to do."""


def require(commands: Iterable[str], doing: str) -> None:
    """Raise ``SlurmCommandMissing`` naming every command of ``commands`` missing from PATH."""
    missing = [c for c in commands if shutil.which(c) is None]
    if missing:
        names = " and ".join(f"`{c}`" for c in missing)
        raise SlurmCommandMissing(
            f"{names} not found on PATH, and {doing} needs the Slurm client: run it on a Slurm login node "
            "(or add Slurm's bin directory to PATH), or set `cluster: local` to run on this machine"
        )
