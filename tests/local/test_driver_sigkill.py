"""A local job whose driver is SIGKILLed (no teardown at all) leaves nothing running: the Ray head and
every process of its Ray session, the router actor, the engine host and its simulated engines, the
training command. Real Ray, real simulated engines, the real router.

Before ``launcher.steps.reaper`` the Ray head (``ray start --block``, its own session), gcs_server, raylet,
the agents, the client server, the engine host with both engines and ``sleep 600`` all stayed up.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from launcher.steps.ray_node import private_temp_dir
from tests.support.jobs import start_job
from tests.support.running_job import job_processes

pytestmark = pytest.mark.ray


def ray_session_processes(job: Path) -> list[str]:
    """Processes naming the job's private Ray temp dir in their command line (gcs_server, raylet,
    the agents, the client server, ``ray start`` itself), whatever their environment."""
    temp = str(private_temp_dir(job)).encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if temp in cmd:
            found.append(f"{pid}: {cmd[:120]!r}")
    return found


def test_a_sigkilled_local_driver_leaves_no_process_of_its_job(tmp_path: Path) -> None:
    proc, job = start_job(tmp_path, "sigkill")
    try:
        before = job_processes(job)
        names = " ".join(before).replace("\\x00", " ")
        for part in ("ray start", "gcs_server", "raylet", "GenerationRouterActor", "engines.host", "sleep"):
            assert part in names, (part, before)
        assert "engines.sim" in names and ray_session_processes(job), before
        os.kill(proc.pid, signal.SIGKILL)  # the driver (rl-launch submit) alone, mid-training
        t0 = time.monotonic()
        proc.wait(10)
        deadline = t0 + 30
        while (job_processes(job) or ray_session_processes(job)) and time.monotonic() < deadline:
            time.sleep(0.2)
        took = time.monotonic() - t0
        left, ray_left = job_processes(job), ray_session_processes(job)
    finally:
        if proc.poll() is None:  # failed before the kill: its own teardown
            proc.terminate()
            proc.wait(60)
        for line in job_processes(job):  # whatever is left of this job, by pid (never by name)
            try:
                os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert left == [] and ray_left == [], (left, ray_left)
    head_log = (job / "logs" / "ray-head.log").read_text()
    assert f"pid {proc.pid}, which started session" in head_log, head_log[-2000:]
    assert not (job / "result.json").exists()  # the driver never got to its teardown
    print(f"\nSIGKILLed local driver: {len(before)} processes of the job, all gone after {took:.1f} s")
