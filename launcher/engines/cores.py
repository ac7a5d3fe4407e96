"""A node's CPU cores split between its engines, and a way to start an engine on its share.

Why: engines that run their model on CPUs (vLLM's CPU build, with no GPU to take) bind their OpenMP
threads to cores, and left to itself every vLLM CPU engine of a node picks the same ones (its "auto"
binding takes the first NUMA node's cores minus one it reserves, identically in every engine): two
engines on a 2-core machine both computed on core 0 while core 1 idled, one engine's requests took
twice as long as the other's, and a restarted engine got no CPU for minutes. The engine host gives each
engine a disjoint share of the cores *it* may use (``os.sched_getaffinity``: on Slurm the step's cpuset,
locally the machine's), the way ``srun --cpu-bind`` would.

How an engine gets its share: it is started from a thread whose affinity is that share
(``started_on``), and a process inherits the affinity of the thread that forks it, so the engine and
everything it forks (API server, engine core, workers) stay on those cores; an engine kind that binds
threads itself reads its cores back with ``os.sched_getaffinity(0)`` (``launcher.engines.vllm.cpu``).
The same read gives an engine started without a host (a Ray Serve replica, a test) the cores of the
process that starts it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


def usable_cores() -> list[int]:
    """The cores this process may run on, in order (the Slurm step's cpuset, or the machine's)."""
    return sorted(os.sched_getaffinity(0))


def split_cores(cores: Sequence[int], count: int) -> tuple[list[list[int]], str | None]:
    """``count`` disjoint consecutive shares of ``cores`` (the first ``len % count`` engines get one
    more), and None; with fewer cores than engines no split can be disjoint: engine ``i`` gets core
    ``i % len(cores)`` (each core shared by as few engines as possible) and the reason comes back as a
    note to print."""
    cores = list(cores)
    if count <= 0:
        return [], None
    if not cores:
        return [[] for _ in range(count)], None
    if count > len(cores):
        note = (
            f"{count} CPU engines on {len(cores)} core(s) ({format_cores(cores)}): engines share cores; "
            "run fewer engines per node or give the step more CPUs (--cpus-per-task)"
        )
        return [[cores[i % len(cores)]] for i in range(count)], note
    size, extra = divmod(len(cores), count)
    out, at = [], 0
    for i in range(count):
        n = size + (1 if i < extra else 0)
        out.append(cores[at : at + n])
        at += n
    return out, None


@contextmanager
def started_on(cores: Sequence[int] | None) -> Iterator[None]:
    """Run the body (an engine's ``start()``) with this thread's affinity set to ``cores``, then put it
    back; nothing changes for None or an empty share. Only the calling thread moves (``pid`` 0 is the
    calling thread for ``sched_setaffinity`` on Linux), so a host's other threads keep their cores."""
    if not cores:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def format_cores(cores: Sequence[int]) -> str:
    """``0-3,6``: the cpulist form of ``taskset -c``, Slurm and vLLM's ``VLLM_CPU_OMP_THREADS_BIND``."""
    parts: list[str] = []
    ordered = sorted(set(cores))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def parse_cores(text: str) -> list[int]:
    """The cores of a cpulist (``0-3,6``); ``ValueError`` for anything else."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi) if hi else int(lo)
        if first < 0 or last < first:
            raise ValueError(f"bad core range {part!r}")
        out.update(range(first, last + 1))
    return sorted(out)
