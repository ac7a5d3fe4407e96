"""Which cores a vLLM CPU engine's OpenMP threads take: ``VLLM_CPU_OMP_THREADS_BIND`` from its share.

How vLLM 0.32's CPU build binds (``vllm/utils/ompmultiprocessing.py``, ``OMPProcessManager``): with
``VLLM_CPU_OMP_THREADS_BIND`` unset (``"auto"``) every engine takes the allowed cores of the first NUMA
node, one logical CPU per physical core, and reserves ``local world size`` of them (the last) for its
scheduler, the same choice in every engine of a node: on a 2-core machine every engine logged
"core ids=[0] reserved_cpus=[1]" and all their workers computed on core 0. Given a cpulist per rank
(``"0-2|3-5"``, ranks split by ``|``), it binds each worker's threads there (``OMP_PLACES``/
``OMP_PROC_BIND``, or the Intel/GNU OpenMP variables under ``LD_PRELOAD``) and sets the worker's
``OMP_NUM_THREADS`` to the list's length; ``VLLM_CPU_NUM_OF_RESERVED_CPU`` is read only by the auto mode
(and only raises the count of cores kept back), so with explicit lists the reserve is ours to leave out.

Our lists (``omp_binding``): the engine's cores are the affinity it was started with (the engine host
gives each engine a disjoint share: ``launcher.engines.cores``). As vLLM's auto mode does, one core per
rank is kept back for the API server and the scheduler when the share has at least two per rank (they
turn every decode step around, and a worker spinning on their core slows each step); with fewer, the
threads take every core of the share and the processes share them. Ranks (TP x PP workers of one engine)
get disjoint consecutive slices; with more ranks than cores, ranks share cores round-robin.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from launcher.engines.cores import format_cores, parse_cores

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
_VLLM_WORDS = ("auto", "nobind")


@dataclass(frozen=True)
class OmpBinding:
    ranks: tuple[tuple[int, ...], ...]
    """The cores of each rank's OpenMP threads."""
    reserved: tuple[int, ...]
    """Cores of the share no OpenMP thread takes: the API server's and the scheduler's."""

    @property
    def env_value(self) -> str:
        return "|".join(format_cores(r) for r in self.ranks)

    def describe(self, cores: Sequence[int]) -> str:
        ranks = "; ".join(f"rank {i}: {format_cores(r)}" for i, r in enumerate(self.ranks))
        kept = (
            f"{format_cores(self.reserved)} kept for the API server and scheduler"
            if self.reserved
            else ("none kept back (too few cores)")
        )
        return f"cores {format_cores(cores)}: OpenMP threads {ranks}; {kept}"


def omp_binding(cores: Sequence[int], ranks: int) -> OmpBinding:
    """The per-rank OpenMP cores of an engine of ``ranks`` workers on ``cores`` (see the module doc)."""
    cores = sorted(set(cores))
    ranks = max(1, ranks)
    if not cores:
        raise ValueError("an engine needs at least one core")
    keep = ranks if len(cores) >= 2 * ranks else 0
    usable, reserved = cores[: len(cores) - keep], cores[len(cores) - keep :]
    if len(usable) < ranks:
        return OmpBinding(tuple((usable[i % len(usable)],) for i in range(ranks)), tuple(reserved))
    size, extra = divmod(len(usable), ranks)
    out, at = [], 0
    for i in range(ranks):
        n = size + (1 if i < extra else 0)
        out.append(tuple(usable[at : at + n]))
        at += n
    return OmpBinding(tuple(out), tuple(reserved))


def check_user_binding(env: Mapping[str, str], cores: Sequence[int], ranks: int) -> str | None:
    """What is wrong with a ``VLLM_CPU_OMP_THREADS_BIND`` the user set (``generation.env``), or None:
    vLLM asserts one list per rank, and a core outside the engine's share is one its threads may not run
    on (the engine host gave it to another engine, or the Slurm step does not have it)."""
    value = env.get(BIND_ENV)
    if value is None or value in _VLLM_WORDS:
        return None
    lists = value.split("|")
    if len(lists) != ranks:
        return (
            f"{BIND_ENV}={value!r} names {len(lists)} core list(s) for {ranks} worker(s) (TP x PP): one each"
        )
    try:
        named = {c for lst in lists for c in parse_cores(lst)}
    except ValueError as exc:
        return f"{BIND_ENV}={value!r} is not a cpulist per worker like '0-3|4-7' ({exc})"
    outside = sorted(named - set(cores))
    if outside:
        return (
            f"{BIND_ENV}={value!r} names core(s) {format_cores(outside)} outside this engine's cores "
            f"{format_cores(cores)}; remove it to let rl-launch split the cores, or name cores within them"
        )
    return None
