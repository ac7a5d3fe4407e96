"""Splitting a running allocation into training and generation hosts, from Slurm's node lists alone.

The split is deterministic from the node list, so every process that reads ``SLURM_JOB_NODELIST`` agrees
on who is who without talking to anyone (see ``launcher.slurm.request`` for the two layouts).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from launcher.spec import ResolvedSpec


def natural_key(host: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key that orders ``gpu2`` before ``gpu10``, as Slurm's node lists do."""
    return tuple(
        (1, int(part), "") if part.isdigit() else (0, 0, part) for part in re.split(r"(\d+)", host) if part
    )


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in host list {text!r}")
    parts.append(text[start:])
    return [p for p in (s.strip() for s in parts) if p]


def _expand_one(pattern: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", pattern)
    if not m:
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end() :]
    values: list[str] = []
    for item in m.group(1).split(","):
        item = item.strip()
        if not item:
            continue
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {item!r} in host list pattern {pattern!r}")
        if not sep:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r} in host list pattern {pattern!r}")
        values.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return [h for v in values for h in _expand_one(head + v + tail)]


def expand_hostlist(nodelist: str) -> list[str]:
    """Expand a Slurm host list (``gpu[01-03,07],cpu5``) without calling ``scontrol``.

    Pure Python so the split is testable anywhere and costs no process per node; zero padding follows
    the range's lower bound, as Slurm's does.
    """
    return [host for part in _split_top_level(nodelist) for host in _expand_one(part)]


@dataclass(frozen=True)
class NodeSplit:
    """Which hosts are training and which generation, in natural order."""

    training: tuple[str, ...]
    generation: tuple[str, ...]

    @property
    def all(self) -> tuple[str, ...]:
        return self.training + self.generation


def split_nodes(resolved: ResolvedSpec, env: Mapping[str, str] | None = None) -> NodeSplit:
    """Split the running allocation into training and generation hosts.

    Single allocation: the first ``training.nodes`` of the sorted ``SLURM_JOB_NODELIST`` are training,
    the rest generation. Hetjob: component 0 (``SLURM_JOB_NODELIST_HET_GROUP_0``) is training,
    component 1 generation. ``cluster: local``: both roles are ``localhost``. A node count that does not
    match the spec raises ``ValueError`` (a resized or mismatched allocation must not be half-used).
    """
    if resolved.slurm is None:
        return NodeSplit(("localhost",), ("localhost",))
    env = os.environ if env is None else env
    want_t, want_g = resolved.training.nodes, resolved.generation.nodes

    def hosts(var: str) -> list[str]:
        value = env.get(var)
        if not value:
            raise ValueError(f"${var} is not set: split_nodes must run inside the job's allocation")
        return sorted(expand_hostlist(value), key=natural_key)

    if resolved.slurm.layout == "single":
        nodes = hosts("SLURM_JOB_NODELIST")
        if len(nodes) != want_t + want_g:
            raise ValueError(
                f"the allocation has {len(nodes)} nodes but the spec asks for {want_t} training + "
                f"{want_g} generation = {want_t + want_g}"
            )
        return NodeSplit(tuple(nodes[:want_t]), tuple(nodes[want_t:]))
    training, generation = hosts("SLURM_JOB_NODELIST_HET_GROUP_0"), hosts("SLURM_JOB_NODELIST_HET_GROUP_1")
    if len(training) != want_t or len(generation) != want_g:
        raise ValueError(
            f"hetjob components have {len(training)} + {len(generation)} nodes but the spec asks for "
            f"{want_t} training + {want_g} generation"
        )
    return NodeSplit(tuple(training), tuple(generation))
