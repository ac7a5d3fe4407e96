"""A local job whose driver is SIGKILLed (no teardown at all) leaves nothing running: the Ray head and
every process of its Ray session, the router actor, the engine host and its simulated engines, the
training command. Real Ray, real simulated engines, the real router.

Before ``launcher.steps.reaper`` the Ray head (``ray start --block``, its own session), gcs_server, raylet,
the agents, the client server, the engine host with both engines and ``sleep 600`` all stayed up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launcher.steps.ray_node import private_temp_dir
from tests.support.cli import RL_LAUNCH
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


def kill_what_is_left(job: Path) -> None:
    """SIGKILL whatever is left of this job after a check, by pid (never by name: other lanes run jobs
    of their own)."""
    for line in job_processes(job):
        try:
            os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass


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
        kill_what_is_left(job)
    assert left == [] and ray_left == [], (left, ray_left)
    head_log = (job / "logs" / "ray-head.log").read_text()
    assert f"pid {proc.pid}, which started session" in head_log, head_log[-2000:]
    assert not (job / "result.json").exists()  # the driver never got to its teardown
    print(f"\nSIGKILLed local driver: {len(before)} processes of the job, all gone after {took:.1f} s")


def reapers_of(job: Path) -> list[int]:
    """The job's reapers (``python -m launcher.steps.reaper``), one per step's session."""
    found = []
    for line in job_processes(job):
        pid, cmd = line.split(":", 1)
        if "launcher.steps.reaper" in cmd:
            found.append(int(pid))
    return found


def rl_launch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RL_LAUNCH, *args], capture_output=True, text=True, timeout=120)


def test_a_job_whose_driver_is_gone_shows_as_gone_and_cancel_cleans_up_after_it(tmp_path: Path) -> None:
    """The driver SIGKILLed together with its reapers (the OOM killer takes several processes; a ``kill -9``
    of a list of pids): the Ray head, the engine host and its engines and the training command keep running
    with nobody to end them. ``list`` and ``status`` say the job is lost (its state still says
    ``training``), and ``rl-launch cancel`` ends what is left and exits 0 saying so. Before: ``status``
    said phase ``training``, and ``cancel`` answered only "the driver ... is not running" (exit 1), leaving
    every process."""
    proc, job = start_job(tmp_path, "gone")
    root = str(tmp_path / "jobs")
    try:
        reapers = reapers_of(job)
        assert len(reapers) >= 3, job_processes(job)  # the Ray head, the engine host, the training command
        for pid in (proc.pid, *reapers):
            os.kill(pid, signal.SIGKILL)
        proc.wait(10)
        time.sleep(1.0)
        left = job_processes(job)
        names = " ".join(left).replace("\\x00", " ")
        assert "ray start" in names and "engines.host" in names and "sleep" in names, left
        assert json.loads((job / "state.json").read_text())["phase"] == "training"
        (row,) = json.loads(rl_launch("list", "--json", "--root", root).stdout)
        status = rl_launch("status", job.name, "--json", "--root", root)
        snap = json.loads(status.stdout)
        t0 = time.monotonic()
        cancel = rl_launch("cancel", job.name, "--root", root)
        took = time.monotonic() - t0
        after = job_processes(job), ray_session_processes(job)
        again = json.loads(rl_launch("list", "--json", "--root", root).stdout)[0]
        status_after = json.loads(rl_launch("status", job.name, "--json", "--root", root).stdout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
        kill_what_is_left(job)
    print(
        f"\nbefore cancel: {len(left)} processes of the job running; list: {row['phase']}: {row['detail']}"
        f"\nstatus: phase {snap['job']['phase']}, {snap['condition']}: {snap['message']}"
        f"\n$ rl-launch cancel {job.name}  (exit {cancel.returncode}, {took:.1f} s)"
        f"\n{cancel.stdout}{cancel.stderr}"
        f"left after: {after}; list: {again['phase']}: {again['detail']}"
    )
    assert row["phase"] == "lost" and f"its driver (pid {proc.pid}) is gone" in row["detail"], row
    assert f"rl-launch cancel {job.name}" in row["detail"], row
    assert snap["job"]["phase"] == "lost" and snap["condition"] == "finished", snap["job"]
    assert snap["message"].startswith("the driver is gone") and "rl-launch cancel" in snap["message"], snap
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    assert f"its driver (pid {proc.pid}) was gone" in cancel.stdout and "ended" in cancel.stdout, (
        cancel.stdout
    )
    assert after == ([], []), after
    assert again["phase"] == "cancelled" and "last phase training" in again["detail"], again
    assert status_after["job"]["phase"] == "cancelled" and status_after["condition"] == "finished"
    result = json.loads((job / "result.json").read_text())
    assert result["outcome"] == "cancelled" and result["torn_down"] is True, result
