"""What the machine did while an arm ran: the CPU of the client, the router and the fleet, and the load.

Why: a replay on one machine measures the router *and* the harness. When the replay client, the router or
the simulated fleet saturates a core (an event loop at 100% answers late, a starved simulator runs
slower than it models), or other work loads the machine past its cores, the arm's times measure that, and
a comparison between arms can flip (the issue behind this module: cache_aware 4.2% *later* than direct
with the fleet in the client's process, 7.8% *sooner* with it in its own). Each arm therefore reports
how busy each of its processes was over the arm's wall time, in cores, and a warning names whichever
could have decided the comparison, so a figure is never read without knowing what it measured.

Read from ``/proc`` (Linux; elsewhere only the load average is reported): ``/proc/<pid>/stat`` for this
process and every descendant (the fleet, the router and its workers, another front's processes), each
labelled by what it runs; ``/proc/stat`` for the machine's busy share.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SATURATED_CORE = 0.85
"""A process above this share of one core over an arm was likely the bottleneck (an asyncio loop, a
simulator's event loop, a router worker: each runs on one core at a time)."""
MACHINE_BUSY = 0.90

_PROC = Path("/proc")
try:
    _TICK = float(os.sysconf("SC_CLK_TCK"))
except (AttributeError, ValueError, OSError):  # not Linux
    _TICK = 100.0


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds user + system) of ``pid``, or None when it is gone or unreadable."""
    try:
        raw = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rfind(")") + 2 :].split()  # after "pid (comm) ": state ppid ... utime stime
    try:
        return int(rest[1]), (int(rest[11]) + int(rest[12])) / _TICK
    except (IndexError, ValueError):
        return None


def _cmdline(pid: int) -> list[str]:
    try:
        return (_PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _role(argv: list[str]) -> str | None:
    """What a process runs, in the report's words; None: whatever its parent runs (a worker)."""
    line = " ".join(argv)
    if "launcher.engines.sim" in line:
        return "fleet"
    if any(
        k in line for k in ("launcher.cli router", "rl-launch router", "router.cli", "router.multiprocess")
    ):
        return "router"
    from launcher.gateways.vllm_router.command import PROGRAM

    if PROGRAM in line or "vllm_router" in line:
        return PROGRAM
    if "multiprocessing" in line or not argv or not argv[0]:
        return None
    return os.path.basename(argv[0]) or None


def _tree(root: int) -> dict[int, tuple[float, str]]:
    """CPU seconds and role of ``root`` (the client) and every process descending from it."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    try:
        pids = [int(p.name) for p in _PROC.iterdir() if p.name.isdigit()]
    except OSError:
        return {}
    for pid in pids:
        st = _stat(pid)
        if st is not None:
            parents[pid], cpu[pid] = st
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, tuple[float, str]] = {}
    if root not in cpu:
        return out
    stack = [(root, "client")]
    while stack:
        pid, inherited = stack.pop()
        role = "client" if pid == root else (_role(_cmdline(pid)) or inherited)
        out[pid] = (cpu[pid], role)
        stack += [(c, role) for c in children.get(pid, []) if c in cpu]
    return out


def _machine() -> tuple[float, float] | None:
    """(busy, total) jiffies of every CPU since boot, from ``/proc/stat``."""
    try:
        first = (_PROC / "stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    vals = [float(v) for v in first[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)  # idle + iowait
    total = sum(vals[:8])  # guest time is already in user
    return total - idle, total


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


@dataclass
class CpuWatch:
    """Snapshot at ``start()``, read the deltas at ``stop()``; ``in_process`` says the client process
    also runs the fleet and the router (``--sim-in-process``), so the warning can say so."""

    in_process: bool = False
    root: int = field(default_factory=os.getpid)
    _t0: float = 0.0
    _before: dict[int, tuple[float, str]] = field(default_factory=dict)
    _machine0: tuple[float, float] | None = None
    _load0: float | None = None

    def start(self) -> CpuWatch:
        self._t0 = time.perf_counter()
        self._before = _tree(self.root)
        self._machine0 = _machine()
        self._load0 = _load()
        return self

    def stop(self) -> dict[str, Any]:
        """``{"cores": n, "wall_s", "processes": {role: {"cores", "max_core", "n"}}, "load_avg",
        "machine_busy", "warnings": [...]}``: CPU in cores (1.0 = one core busy the whole arm)."""
        wall = max(1e-6, time.perf_counter() - self._t0)
        after = _tree(self.root)
        machine1 = _machine()
        load1 = _load()
        cores = os.cpu_count() or 1
        roles: dict[str, dict[str, Any]] = {}
        for pid, (cpu, role) in after.items():
            used = (cpu - self._before[pid][0]) if pid in self._before else cpu  # started during the arm
            share = max(0.0, used) / wall
            r = roles.setdefault(role, {"cores": 0.0, "max_core": 0.0, "max_pid": pid, "n": 0})
            r["cores"] += share
            r["n"] += 1
            if share >= r["max_core"]:
                r["max_core"], r["max_pid"] = share, pid
        for r in roles.values():
            r["cores"], r["max_core"] = round(r["cores"], 3), round(r["max_core"], 3)
        busy = None
        if self._machine0 is not None and machine1 is not None:
            d_total = machine1[1] - self._machine0[1]
            if d_total > 0:
                busy = round((machine1[0] - self._machine0[0]) / d_total, 3)
        loads = [x for x in (self._load0, load1) if x is not None]
        load = round(max(loads), 2) if loads else None
        return {
            "cores": cores,
            "wall_s": round(wall, 3),
            "processes": roles,
            "load_avg": load,
            "machine_busy": busy,
            "warnings": warnings_for(roles, load, busy, cores, self.in_process),
        }


def warnings_for(
    roles: dict[str, dict[str, Any]],
    load: float | None,
    busy: float | None,
    cores: int,
    in_process: bool = False,
) -> list[str]:
    """One sentence per thing that could have decided the arm's figures instead of the router."""
    out: list[str] = []
    for role, r in sorted(roles.items()):
        if r["max_core"] <= SATURATED_CORE:
            continue
        what = role
        if role == "client" and in_process:
            what = "client (which runs the fleet and the router too: --sim-in-process)"
        out.append(
            f"the {what} process (pid {r['max_pid']}) ran at {100 * r['max_core']:.0f}% of a core: it, not "
            "the routing, may have set this arm's times"
        )
    if load is not None and load > cores:
        out.append(
            f"load average {load:.1f} on {cores} cores: other work shares the CPUs, so the machine, not "
            "the routing, may decide the comparison"
        )
    elif busy is not None and busy > MACHINE_BUSY:
        out.append(f"the machine's {cores} cores were {100 * busy:.0f}% busy during the arm")
    return out


def cpu_line(arm: str, cpu: dict[str, Any]) -> str:
    """``arm: client 0.41, router 0.62 (2), fleet 0.93 cores; load 1.2/2; machine 78% busy``."""
    parts = []
    for role, r in sorted(cpu.get("processes", {}).items(), key=lambda kv: -kv[1]["cores"]):
        n = f" ({r['n']})" if r["n"] > 1 else ""
        parts.append(f"{role} {r['cores']:.2f}{n}")
    load = cpu.get("load_avg")
    busy = cpu.get("machine_busy")
    tail = f"; load {load:.1f}/{cpu['cores']}" if load is not None else ""
    tail += f"; machine {100 * busy:.0f}% busy" if busy is not None else ""
    return f"{arm}: CPU in cores: {', '.join(parts) or '-'}{tail}"
