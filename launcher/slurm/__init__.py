"""Slurm in one place: time strings (``time``), sbatch options (``options``), the request (``request``),
the ``srun`` command lines (``srun``) and the allocation split (``nodes``).

Names are re-exported lazily (PEP 562 ``__getattr__``): ``launcher.spec`` imports the pure ``time`` and
``options`` modules, and an eager import of ``request`` here (which reads spec types) would turn that into
an import cycle between the two packages.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "format_time": "time",
    "parse_time": "time",
    "time_minutes": "time",
    "check_sbatch_option": "options",
    "parse_sbatch_option": "options",
    "SlurmComponent": "request",
    "SlurmRequest": "request",
    "build_request": "request",
    "NodeSplit": "nodes",
    "expand_hostlist": "nodes",
    "natural_key": "nodes",
    "split_nodes": "nodes",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'launcher.slurm' has no attribute {name!r}")
    return getattr(importlib.import_module(f"launcher.slurm.{module}"), name)
