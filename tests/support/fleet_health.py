"""A ``FleetHealth`` of engines ``e0..eN`` on a fake clock, for the tests of the fleet-health state machine.

Pure and deterministic: ``make(n, **policy)`` gives the fleet and its ``Clock`` (advanced by hand), engine
``i`` listens on ``url(i)``; ``front_tick`` is one tick with every probe passing and the front holding
``stale`` engines out.
"""

from __future__ import annotations

from launcher.fleet import EngineRecord, FleetHealth, HealthPolicy, ProbeResult, TickInput, TickResult


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def url(i: int) -> str:
    return f"http://10.0.0.1:{8000 + i}"


def make(n: int = 3, **policy: object) -> tuple[FleetHealth, Clock]:
    clock = Clock()
    engines = [EngineRecord(f"e{i}", f"node{i % 2}", url(i) + "/v1") for i in range(n)]
    return FleetHealth(engines, HealthPolicy(**policy), clock=clock), clock  # type: ignore[arg-type]


def front_tick(fleet: FleetHealth, clock: Clock, stale: dict[str, str] | None) -> TickResult:
    """One tick with every probe passing and the front holding ``stale`` out (``None``: no answer)."""
    clock.t += 1.0
    probes: dict[str, ProbeResult | bool] = {u: True for u in fleet.probe_targets().values()}
    return fleet.observe(TickInput(probes=probes, stale=stale))
