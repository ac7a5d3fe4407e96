"""The driver's stop signals while Ray connects: ``ray.init`` makes SIGTERM ``sys.exit(15)`` for its whole
duration (seconds on a loaded node), which used to skip the teardown and the result entirely and leave the
Ray head running after a ``scancel``. No real Ray here: a stand-in cluster does exactly what ray.init does
to the signal, so the window is hit every time."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from launcher.driver import driver as driver_module
from launcher.driver.driver import Driver
from launcher.jobdir import JobDir
from launcher.spec import load_resolved


class RayInitUnderSigterm:
    """``start_head`` and ``stop`` are recorded; ``connect_and_wait`` installs Ray's handler and is
    interrupted by a SIGTERM, as a scancel during ray.init would."""

    instances: list[RayInitUnderSigterm] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.calls: list[str] = []
        self.workers: list[Any] = []
        self.address = "127.0.0.1:1"
        self.disconnected = True
        RayInitUnderSigterm.instances.append(self)

    def start_head(self) -> None:
        self.calls.append("start_head")

    def connect_and_wait(self, expected_nodes: int, deadline: float) -> None:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # what ray.init installs
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the signal was not delivered")

    def stop(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("stop")


def test_sigterm_during_ray_init_unwinds_through_teardown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(driver_module, "RayCluster", RayInitUnderSigterm)
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(
        yaml.safe_dump(
            {
                "name": "sigterm-in-init",
                "cluster": "local",
                "job_root": str(tmp_path / "jobs"),
                "training": {"command": "true"},
                "generation": {"engine": "sim"},
            }
        )
    )
    previous = signal.getsignal(signal.SIGTERM)
    try:
        code = Driver(load_resolved(spec_path), tmp_path / "jobs" / "j", ["localhost"], ["localhost"]).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 128 + signal.SIGTERM
    (ray,) = RayInitUnderSigterm.instances
    assert ray.calls == ["start_head", "stop"]  # the head it started is stopped
    result = JobDir(tmp_path / "jobs" / "j").read_result()
    assert result is not None
    assert (result.outcome, result.signal, result.torn_down) == ("cancelled", "SIGTERM", True)
