"""The ``srun`` command lines of a job: the driver's own step and the steps the driver starts on nodes.

One builder for the launch paths and for ``submit --dry-run``, so what the dry run prints is what runs.

Containers (pyxis/enroot): every process of the job runs in the spec's container. The batch script itself
cannot (it runs on the host, where Slurm puts it), so with a container the batch shell ``exec``s the driver
as a one-task ``srun`` step in the container on its own node; the driver's children (Ray head, router,
training command) inherit the container, and every step the driver starts (Ray workers, engine hosts)
carries the same ``--container-*`` arguments. The image must therefore be able to call ``srun`` (most
sites mount the Slurm client into pyxis containers; see docs/operations.md, "Containers"). Without a
container the batch shell ``exec``s the driver directly, as before.

Why ``exec``: the time-limit warning is requested as ``--signal=B:USR2@N`` (batch shell only: the engine
and Ray steps must not die of it), so the batch shell must *be* the driver, or be the ``srun`` that
forwards the signal to it; a shell waiting on a child would die of SIGUSR2 and leave the driver unwarned.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from launcher.spec import Container

WARNING_SIGNAL = "USR2"
"""Sent to the driver (only) before the time limit; the driver tears the job down on it."""
MAX_WARNING_LEAD_S = 90


def warning_lead_s(time_limit_s: int) -> int:
    """Seconds before the limit the warning is sent: 90 (submitit's lead), less for short jobs so a
    10-minute test job is not warned at once (at most a quarter of the limit, at least 10 s)."""
    return max(10, min(MAX_WARNING_LEAD_S, time_limit_s // 4))


def signal_option(time_limit_s: int) -> str:
    """``sbatch --signal`` value: ``B:`` sends it to the batch shell (the driver) and no other step."""
    return f"B:{WARNING_SIGNAL}@{warning_lead_s(time_limit_s)}"


def container_args(container: Container | None) -> tuple[str, ...]:
    """pyxis arguments for every step of the job (empty without a container)."""
    if container is None:
        return ()
    args = [f"--container-image={container.image}"]
    if container.mounts:
        args.append(f"--container-mounts={','.join(container.mounts)}")
    if container.workdir:
        args.append(f"--container-workdir={container.workdir}")
    return tuple(args)


def driver_step_prefix(container: Sequence[str]) -> list[str]:
    """What runs the driver: nothing (the batch shell ``exec``s it) or, with a container, a one-task step
    on the batch node (``$SLURMD_NODENAME``, expanded by the batch shell). ``--overlap`` lets the steps the
    driver starts share that node; ``--kill-on-bad-exit=1`` ends the job if the driver dies."""
    if not container:
        return []
    return [
        "srun",
        "--nodes=1",
        "--ntasks=1",
        '--nodelist="$SLURMD_NODENAME"',
        "--overlap",
        "--kill-on-bad-exit=1",
        "--export=ALL",
        "--job-name=driver",
        *container,
    ]


def driver_launch_line(container: Sequence[str], command: str) -> str:
    """The batch script's last line: ``exec [srun ... container] COMMAND`` (``command`` is shell text).

    Arguments of the prefix are quoted except ``$SLURMD_NODENAME``, which the batch shell must expand.
    """
    words = [w if w.startswith('--nodelist="$') else shlex.quote(w) for w in driver_step_prefix(container)]
    return " ".join(["exec", *words, command])


def step_command(
    *,
    node: str,
    name: str,
    log: str | Path,
    argv: Sequence[str],
    container: Sequence[str] = (),
    gpus: int = 0,
    het_group: int | None = None,
    jobid: str | None = None,
) -> list[str]:
    """``srun`` argv for one long-lived process on ``node`` (a Ray worker, an engine host).

    ``jobid``: in that job's allocation (a grow job's node, ``launcher.fleet.elastic``) rather than the
    one the caller runs in; Slurm lets a user start steps in any of their running jobs.

    ``--overlap`` lets steps share the node's CPUs with the driver's own step; ``--kill-on-bad-exit=0``
    so one engine host's death is reported by the driver (naming the node) instead of killing the whole
    job; ``--export=ALL`` carries the driver's environment (venv, RAY_* settings).
    """
    cmd = [
        "srun",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        "--overlap",
        "--kill-on-bad-exit=0",
        "--export=ALL",
        f"--job-name={name}",
        f"--output={log}",
    ]
    if jobid is not None:
        cmd.append(f"--jobid={jobid}")
    if het_group is not None:
        cmd.append(f"--het-group={het_group}")
    if gpus:
        cmd.append(f"--gpus-per-node={gpus}")
    return [*cmd, *container, *argv]
