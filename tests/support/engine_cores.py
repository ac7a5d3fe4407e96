"""Which cores each local vLLM CPU engine runs on, read from outside: its log and its processes' affinity.

Two witnesses, because either alone can mislead: vLLM's own log line ("OpenMP thread binding info ...
local_rank=0, core ids=[0] ... reserved_cpus=[1]") says where it *meant* to bind its OpenMP threads, and
``sched_getaffinity`` of every thread of the engine's processes says where the kernel lets them run
(what ``taskset -p`` prints). Used by the real-vLLM pinning test and ``bench/cpu_engines.py``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_RANK_CORES = re.compile(r"local_rank=(\d+), core ids=\[([\d, ]*)\]")
_RESERVED = re.compile(r"reserved_cpus=\[([\d, ]*)\]")
_BIND_ENV = re.compile(r"VLLM_CPU_OMP_THREADS_BIND='([^']*)'")


def _ids(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


@dataclass
class LogBinding:
    """vLLM's last "OpenMP thread binding info" of one engine log (a restarted engine appends its own)."""

    bind_env: str
    rank_cores: dict[int, list[int]]
    reserved: list[int]

    def line(self) -> str:
        ranks = " ".join(f"rank {r}: core ids={c}" for r, c in sorted(self.rank_cores.items()))
        return f"VLLM_CPU_OMP_THREADS_BIND={self.bind_env!r} {ranks} reserved_cpus={self.reserved}"


def log_binding(log: Path) -> LogBinding | None:
    """The binding the log names last, or None before vLLM printed one."""
    text = log.read_text(errors="replace")
    start = text.rfind("OpenMP thread binding info")
    if start < 0:
        return None
    block = text[start : start + 4000]
    reserved = _RESERVED.search(block)
    env = _BIND_ENV.search(block)
    return LogBinding(
        bind_env=env.group(1) if env else "?",
        rank_cores={int(m.group(1)): _ids(m.group(2)) for m in _RANK_CORES.finditer(block)},
        reserved=_ids(reserved.group(1)) if reserved else [],
    )


@dataclass
class Proc:
    pid: int
    title: str
    affinity: list[int]
    """The union of every thread's allowed cores."""
    threads: dict[int, list[int]] = field(default_factory=dict)
    """Each thread's allowed cores (OpenMP binds threads one by one)."""


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _pgid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def server_pgid(port: int) -> int | None:
    """The process group of the vLLM API server serving ``port`` (the engine's whole group)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        argv = _cmdline(int(d.name))
        if (
            API_SERVER_MODULE in argv
            and "--port" in argv
            and argv[argv.index("--port") + 1 :][:1] == [str(port)]
        ):
            return _pgid(int(d.name))
    return None


def group_processes(pgid: int) -> list[Proc]:
    """Every live process of the group with its title (vLLM names them ``VLLM::Worker`` and the like)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or _pgid(int(d.name)) != pgid:
            continue
        pid = int(d.name)
        argv = _cmdline(pid)
        threads: dict[int, list[int]] = {}
        try:
            for t in (d / "task").iterdir():
                try:
                    threads[int(t.name)] = sorted(os.sched_getaffinity(int(t.name)))
                except OSError:
                    pass
        except OSError:
            continue
        if not threads:
            continue
        union = sorted({c for cs in threads.values() for c in cs})
        # the interpreter by its name alone: a path would name this machine's checkout in the figures
        title = " ".join([Path(argv[0]).name, *argv[1:3]]) if argv else ""
        if argv and argv[0].startswith("VLLM::"):
            title = argv[0]
        out.append(Proc(pid, title, union, threads))
    return sorted(out, key=lambda p: p.pid)


def workers(procs: list[Proc]) -> list[Proc]:
    """The model workers (``VLLM::Worker``, ``VLLM::Worker_TP1``...): where the OpenMP threads run."""
    return [p for p in procs if p.title.startswith("VLLM::Worker")]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far (all its threads), 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
