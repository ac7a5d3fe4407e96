"""Running a long-lived process on a node: a ``srun`` step on Slurm, a plain subprocess in local mode.

One interface for both, so the driver's logic (start Ray workers and engine hosts, watch them, stop them)
is the same code in local mode and on a cluster, and the local mode tests it.

Stopping: SIGTERM first (``srun`` forwards it to the step's tasks; the engine host and ``ray start
--block`` clean up on it), then SIGKILL to the whole process group after a grace period, and on Slurm a
final ``scancel`` of the step so nothing of it survives even where ``proctrack/linuxproc`` would leave
background processes behind.

A driver that dies without its teardown (SIGKILL, the OOM killer) stops nothing: on Slurm the job's end
takes its steps with it; in local mode each step's reaper (``launcher.steps.reaper``) ends the step's session.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from launcher.slurm.srun import step_command
from launcher.steps.reaper import guard


@dataclass
class Step:
    """A process (or srun step) started on ``node`` for ``role``."""

    node: str
    role: str
    proc: subprocess.Popen[bytes]
    log: Path
    step_name: str = ""
    reaper: subprocess.Popen[bytes] | None = None
    """Local mode: the process that ends this step's session if the driver dies
    (``launcher.steps.reaper``)."""
    _stopped: bool = field(default=False, repr=False)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def returncode(self) -> int | None:
        return self.proc.poll()

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 15.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.proc.poll() is None:
            _signal_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc, signal.SIGKILL)
                self.proc.wait(10)
        if self.reaper is not None:
            # It sees the session end within its poll and exits: wait for it, so no zombie is left.
            try:
                self.reaper.wait(1)
            except subprocess.TimeoutExpired:
                pass


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


class LocalSteps:
    """Local mode: every "node" is this machine. Each step's session is guarded by a reaper
    (``launcher.steps.reaper``): nothing else would end it if the driver died without its teardown (on Slurm,
    the job's end does)."""

    def start(
        self,
        node: str,
        role: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log: Path,
        gpus: int = 0,
        het_group: int | None = None,
        jobid: str | None = None,
    ) -> Step:
        with log.open("ab") as out:
            proc = subprocess.Popen(
                list(argv), env=dict(env), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return Step(node=node, role=role, proc=proc, log=log, reaper=guard(proc, log))


class SrunSteps:
    """Slurm: one ``srun`` step per process, pinned to one node of the allocation; the command line
    (and why each option) is ``launcher.slurm.srun.step_command``. ``srun_args`` are the container's
    ``--container-*`` arguments, given to every step."""

    def __init__(self, srun_args: Sequence[str] = ()) -> None:
        self.srun_args = list(srun_args)

    def start(
        self,
        node: str,
        role: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log: Path,
        gpus: int = 0,
        het_group: int | None = None,
        jobid: str | None = None,
    ) -> Step:
        """``jobid``: start the step in that job's allocation instead of the driver's (a grow's nodes)."""
        cmd = step_command(
            node=node,
            name=role,
            log=log,
            argv=argv,
            container=self.srun_args,
            gpus=gpus,
            het_group=het_group,
            jobid=jobid,
        )
        proc = subprocess.Popen(
            cmd, env=dict(env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        return Step(node=node, role=role, proc=proc, log=log, step_name=role)


def wait_for_file(path: Path, steps: Sequence[Step], deadline: float, poll_s: float = 0.2) -> None:
    """Wait until ``path`` exists; fail fast (naming the node) if one of ``steps`` dies first."""
    while not path.exists():
        for step in steps:
            if not step.alive():
                raise RuntimeError(
                    f"{step.role} on node {step.node} exited with {step.returncode()} before it was ready;"
                    f" log {step.log}:\n{step.log_tail()}"
                )
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear before the deadline")
        time.sleep(poll_s)


def node_address(node: str, local: bool) -> str:
    """The address other nodes reach ``node`` at (local mode: loopback only)."""
    if local:
        return "127.0.0.1"
    return socket.gethostbyname(node)
