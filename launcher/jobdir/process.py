"""Naming a process so that a recycled pid is never mistaken for it: pid plus kernel start time; and
telling a job's driver from any other process before it is signalled.

``rl-launch cancel`` and ``rl-launch fleet down`` signal a local job's driver by the pid recorded in the
job state. If that driver died and the pid went to another process, a bare pid would have them signal a
stranger; and a state that another user wrote (or one that names the wrong process) must never get a
signal sent for it. ``driver_pid`` is the one check both commands make.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_LOCAL_JOB = re.compile(r"-local-\d{8}-\d{6}-(\d+)$")
"""A local job's directory name, ``<name>-local-<date>-<time>-<pid of its driver>``
(``launcher.driver.entry.run_in_allocation``): how a driver started as ``rl-launch submit SPEC``
(whose command line names no job directory) is matched to its job."""

_CLI_MODULES = ("launcher.cli", "launcher.cli.__main__")
_RUN_LOCAL = "launcher.driver.run_local"


class NotTheDriver(RuntimeError):
    """The pid a job's state names is not provably that job's driver, so it is not signalled; the
    message is one line naming the job, the pid and the reason."""


def stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name (state, ppid, pgrp, session, ...); None if gone (or no
    procfs). Split after the last ``)``: a command name may hold spaces and parentheses of its own."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22); None if no
    such process (or no procfs)."""
    fields = stat_fields(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def is_zombie(pid: int) -> bool:
    """``pid`` has exited and waits for its parent to collect it (state ``Z``): it runs no more, though
    its pid and start time still read as before (a SIGKILLed ``rl-launch submit`` whose parent has not
    waited for it looked alive to ``list``, ``status`` and ``cancel``)."""
    fields = stat_fields(pid)
    return bool(fields) and fields[0] == "Z"


def is_same_process(pid: int, ticks: int | None) -> bool:
    """Whether ``pid`` still runs (and, with ``ticks``, is the process that started then); an exited
    process not yet collected by its parent (a zombie) does not. For liveness only: with no ``ticks``
    any process holding the pid counts, so never signal on this alone."""
    now = start_ticks(pid)
    return now is not None and (ticks is None or now == ticks) and not is_zombie(pid)


def process_uids(pid: int) -> tuple[int, int] | None:
    """``(real, effective)`` uid of ``pid`` (``/proc/<pid>/status``); None when it is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("Uid:"):
            fields = line.split()
            return int(fields[1]), int(fields[2])
    return None


def process_argv(pid: int) -> list[str] | None:
    """The command line of ``pid``; None when it is gone (or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]] if raw else []


def _python_target(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """``("module", name, args)`` for ``python [flags] -m name args``, ``("script", path, args)`` for
    ``python [flags] path args`` (a console script such as ``rl-launch``, as the kernel runs its shebang)
    and for a script run directly; None for ``python -c`` or an empty line."""
    if not argv:
        return None
    if not os.path.basename(argv[0]).startswith("python"):
        return "script", argv[0], argv[1:]
    rest = argv[1:]
    while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c", "-"):
        rest = rest[1:]
    if not rest or rest[0] in ("-c", "-"):
        return None
    if rest[0] == "-m":
        return ("module", rest[1], rest[2:]) if len(rest) > 1 else None
    return "script", rest[0], rest[1:]


def _same_dir(arg: str, cwd: Path | None, job: Path) -> bool:
    p = Path(arg)
    if not p.is_absolute():
        if cwd is None:
            return False
        p = cwd / p
    return p.resolve() == job.resolve()


def runs_driver_of(argv: list[str], cwd: Path | None, job: Path, pid: int) -> bool:
    """Whether ``argv`` (of process ``pid``, working in ``cwd``) is the driver of job directory ``job``:
    ``python -m launcher.driver.run_local JOB`` (a local standing fleet), or ``rl-launch submit`` with
    ``--job-dir JOB`` or, for a local job, the pid its directory's name ends in."""
    target = _python_target(argv)
    if target is None:
        return False
    kind, name, args = target
    if kind == "module" and name == _RUN_LOCAL:
        return bool(args) and _same_dir(args[0], cwd, job)
    is_cli = (kind == "module" and name in _CLI_MODULES) or (
        kind == "script" and os.path.basename(name) == "rl-launch"
    )
    if not is_cli or not args or args[0] != "submit":
        return False
    for i, a in enumerate(args):
        if a == "--job-dir" and i + 1 < len(args):
            return _same_dir(args[i + 1], cwd, job)
        if a.startswith("--job-dir="):
            return _same_dir(a.split("=", 1)[1], cwd, job)
    m = _LOCAL_JOB.search(job.name)
    return m is not None and int(m.group(1)) == pid


def driver_pid(job: Path, state: Mapping[str, Any]) -> int:
    """The pid of job directory ``job``'s local driver, to be signalled; ``NotTheDriver`` unless it is
    recorded with its start time, runs on this host, started at that time, runs as the caller (real and
    effective uid) and its command line is this job's driver (``runs_driver_of``).

    Each check stops a different wrong signal: the start time a recycled pid; the uid a process of
    another user (root could signal it); the command line any other process of the caller's that a state
    names, whoever wrote that state."""
    pid = state.get("driver_pid")
    if not pid:
        raise NotTheDriver(f"{job} records no driver process (it has not started)")
    pid = int(pid)
    host = state.get("driver_host")
    if host and host != socket.gethostname():
        raise NotTheDriver(f"the driver of {job} runs on {host}; run this there")
    ticks = state.get("driver_start_ticks")
    if ticks is None:
        raise NotTheDriver(
            f"the driver of {job} (pid {pid}) recorded no start time, so the pid may name any process by "
            "now: not signalled"
        )
    if start_ticks(pid) != ticks:
        raise NotTheDriver(f"the driver of {job} (pid {pid}) is not running")
    uids = process_uids(pid)
    if uids is None:
        raise NotTheDriver(f"the driver of {job} (pid {pid}) is not running")
    if uids != (os.getuid(), os.getuid()):
        from launcher.jobdir.ownership import user_label

        raise NotTheDriver(
            f"pid {pid}, named as the driver of {job}, runs as {user_label(uids[1])}, not as you: not "
            "signalled"
        )
    argv = process_argv(pid) or []
    try:
        cwd: Path | None = Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        cwd = None
    if not runs_driver_of(argv, cwd, job, pid):
        shown = " ".join(argv)[:120] or "?"
        raise NotTheDriver(f"pid {pid} is not the driver of {job} (it runs `{shown}`): not signalled")
    return pid
