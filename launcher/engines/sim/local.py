"""A simulated fleet on this machine, for the bench's arms, the fronts' bench arms and the tests.

It lives with the simulator (floor 2, beside the kinds) rather than in the bench: the vLLM Router
front's bench arm needs it too, and a front importing the bench (floor 5) ran the floors backwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any


def url_root(url: str) -> str:
    """``http://h:p/v1`` -> ``http://h:p`` (an engine's root URL, which the routers and scrapes take)."""
    u = url.rstrip("/")
    return u[:-3] if u.endswith("/v1") else u


def _sim_fleet_cls() -> Any:
    try:
        from launcher.engines.sim import SimFleet
    except ImportError as exc:  # the simulator is a separate package of this project
        raise RuntimeError(f"--compare needs the vLLM simulator (launcher.engines.sim): {exc}") from exc
    return SimFleet


@contextlib.contextmanager
def sim_fleet(
    n_engines: int, sim_options: Mapping[str, Any] | None = None, *, process: bool = False
) -> Iterator[list[str]]:
    """Start ``n_engines`` simulated vLLM engines; yield their root URLs; stop them on exit.

    ``sim_options`` are ``SimConfig`` fields (``speed``, ``num_gpu_blocks``, ...); the simulator rejects
    an unknown one rather than ignore it, since a silently dropped knob would change what is measured.
    In-process the fleet runs on a background thread of this process; with ``process`` it runs in a
    child process (``python -m launcher.engines.sim``), so the engines' CPU time does not compete with
    the client and the router for this process's GIL, at the cost of a slower start. The replay's
    default is the child process (``run_compare``); in-process is for tests and debugging.
    """
    if process:
        import time

        from launcher.engines.base import EngineSpec
        from launcher.engines.sim import SimEngine
        from launcher.engines.sim.cli import options_to_flags

        args = options_to_flags(dict(sim_options or {}))
        engine = SimEngine(
            EngineSpec(model="sim-model", startup_timeout_s=60.0, extra_args=args), engines=n_engines
        )
        engine.start()
        try:
            engine.wait_ready(time.monotonic() + 60.0)
            yield [url_root(u) for u in engine.urls]
        finally:
            engine.stop()
        return
    try:
        fleet = _sim_fleet_cls()(n_engines, **dict(sim_options or {}))
    except TypeError as exc:  # an unknown SimConfig field: a usage error, not a crash
        raise ValueError(f"simulator option: {exc}") from exc
    urls = fleet.start()
    try:
        yield [url_root(u) for u in urls]
    finally:
        fleet.stop()
