"""Fleet health for the on-allocation driver: decide which engines serve, which restart, which retire.

Pure decisions only (``launcher.fleet.health``); the driver does the probing, restarting and pushing.
"""

from launcher.fleet.health import (
    PENDING_STATES,
    SERVING_STATES,
    EngineRecord,
    EngineState,
    Evidence,
    FleetEvent,
    FleetHealth,
    HealthPolicy,
    ProbeResult,
    TickInput,
    TickResult,
    Verdict,
    judge_tick,
    judge_window,
)

__all__ = [
    "PENDING_STATES",
    "SERVING_STATES",
    "EngineRecord",
    "EngineState",
    "Evidence",
    "FleetEvent",
    "FleetHealth",
    "HealthPolicy",
    "ProbeResult",
    "TickInput",
    "TickResult",
    "Verdict",
    "judge_tick",
    "judge_window",
]
