"""A vLLM-compatible engine simulator: routing experiments at scale and launcher tests without GPUs.

In-process: ``SimServer`` (one engine) and ``SimFleet`` (N engines in one event loop, on OS-chosen
ports, from async code or a background thread). Out of process: ``SimEngine``, the launcher's
``Engine`` running ``python -m launcher.engines.sim``. Knobs and calibration: ``SimConfig``; fault
modes: ``FaultSpec`` (module ``faults``).
"""

from .config import SimConfig
from .faults import FAULT_MODES, FaultSpec
from .fleet import SimFleet
from .process import SimEngine
from .server import SimServer

__all__ = ["FAULT_MODES", "FaultSpec", "SimConfig", "SimEngine", "SimFleet", "SimServer"]
