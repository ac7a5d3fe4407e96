"""Simulated engines as their own processes (``SimEngine``), for tests that kill one with SIGKILL mid-stream:
an in-process ``SimServer`` cannot die the way an engine does."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from launcher.engines.base import EngineSpec
from launcher.engines.sim import SimEngine


@contextlib.contextmanager
def sim_processes(log_dir: Path, n: int = 2) -> Iterator[list[SimEngine]]:
    """``n`` simulated engines, each its own process, ready; all stopped on exit, however it ends."""
    made: list[SimEngine] = []
    try:
        for i in range(n):
            spec = EngineSpec(model="sim", log_path=str(log_dir / f"sim{i}.log"), startup_timeout_s=60)
            engine = SimEngine(spec)
            engine.start_and_wait()
            made.append(engine)
        yield made
    finally:
        for engine in made:
            engine.stop(grace_s=5)
