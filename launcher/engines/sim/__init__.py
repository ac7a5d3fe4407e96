"""A vLLM-compatible engine simulator: routing experiments at scale and launcher tests without GPUs.

In-process: ``SimServer`` (one engine) and ``SimFleet`` (N engines in one event loop, on OS-chosen
ports, from async code or a background thread). Out of process: ``SimEngine``, the launcher's
``Engine`` running ``python -m launcher.engines.sim``. Knobs and calibration: ``SimConfig``; fault
modes: ``FaultSpec`` (module ``faults``).
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import SimConfig
from .faults import FAULT_MODES, FaultSpec

# The server side (aiohttp, numpy) loads on first use (PEP 562): spec validation reads SimConfig and
# FaultSpec only, and must not pay for the servers.
_LAZY = {"SimFleet": ".fleet", "SimEngine": ".process", "SimServer": ".server"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __name__), name)


__all__ = ["FAULT_MODES", "FaultSpec", "SimConfig", "SimEngine", "SimFleet", "SimServer"]
