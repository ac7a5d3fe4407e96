"""The fleet wing: everything that keeps the generation engines serving and lets a trainer drive them.

* ``launcher.fleet.health``: the pure state machine (which engines serve, restart, retire); no I/O.
* ``launcher.fleet.controller``: the driver's loop around it (probe, drain, judge, push, restart).
* ``launcher.fleet.client``: the trainer's handle on the front's ``/fleet/*`` routes (no Ray, no
  driver).

The wing's engine client is ``router.fleet.engine.EngineClient`` (health, weight version, is-paused,
counters, cache reset, and the refit operations): it lives under ``router/`` because the router, which
runs as its own process and never imports ``launcher``, calls the engines through it too, and one owner
of the engine's HTTP contract (paths, the engine key on every route but ``/health``, how answers read) is
what keeps the controller's reads and the router's fan-outs from drifting apart.

Only the health names are exported here, and the package imports nothing else on import: the controller
pulls in the gateways (which import this package) and the client must stay importable in a trainer
without Ray or the driver, so each is imported by its module path.
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
