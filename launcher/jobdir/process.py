"""Naming a process so that a recycled pid is never mistaken for it: pid plus kernel start time.

``rl-launch cancel`` signals a local job's driver by the pid recorded in the job state; if that driver
died and the pid went to another process, a bare pid would have it signal a stranger.
"""

from __future__ import annotations

from pathlib import Path


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22); None if no
    such process (or no procfs)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19]) if len(fields) > 19 else None


def is_same_process(pid: int, ticks: int | None) -> bool:
    now = start_ticks(pid)
    return now is not None and (ticks is None or now == ticks)
