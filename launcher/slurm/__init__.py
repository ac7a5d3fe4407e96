"""Slurm side of the launcher: what to ask Slurm for (``request``), and how the allocation is split."""

from launcher.slurm.request import (
    NodeSplit,
    SlurmComponent,
    SlurmRequest,
    build_request,
    expand_hostlist,
    format_time,
    parse_time,
    split_nodes,
)

__all__ = [
    "NodeSplit",
    "SlurmComponent",
    "SlurmRequest",
    "build_request",
    "expand_hostlist",
    "format_time",
    "parse_time",
    "split_nodes",
]
