"""Stopping a local job every way a user does: SIGTERM, ``rl-launch cancel``, SIGINT, and Slurm's
time-limit warning (SIGUSR2), against real Ray, real simulated engines and the real router.

Each must unwind through the driver's one teardown: the result recorded with the outcome and signal,
the state final (no engine left HEALTHY), and no process of the job left. SIGTERM in particular: Ray's
``ray.init`` installs its own SIGTERM handler in the driver, which used to win (exit 134, no result).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.cli import RL_LAUNCH
from tests.support.jobs import start_job
from tests.support.running_job import job_processes

pytestmark = pytest.mark.ray


def wait_result(job: Path, timeout_s: float = 60) -> tuple[float, float]:
    """Seconds until the result is first recorded, and until it is recorded as torn down."""
    t0 = time.monotonic()
    first = None
    while True:
        result = json.loads((job / "result.json").read_text()) if (job / "result.json").exists() else None
        if result is not None and first is None:
            first = time.monotonic() - t0
        if result is not None and result["torn_down"]:
            assert first is not None
            return first, time.monotonic() - t0
        assert time.monotonic() - t0 < timeout_s, f"no final result.json after {timeout_s} s"
        time.sleep(0.05)


def assert_final(job: Path, outcome: str, signame: str) -> None:
    result = json.loads((job / "result.json").read_text())
    assert (result["outcome"], result["signal"]) == (outcome, signame), result
    assert result["exit_code"] == 128 + signal.Signals[signame].value
    assert "teardown_s" in result["timings"] and result["torn_down"] is True
    # the router's admin token: its own 0600 file beside the API key, in no other file of the job
    admin, key = job / "secrets" / "admin_token", job / "secrets" / "api_key"
    assert oct(admin.stat().st_mode)[-3:] == "600" and admin.read_text() != key.read_text()
    token = admin.read_text().strip()
    assert [
        f for f in job.rglob("*") if f.is_file() and f != admin and token in f.read_text(errors="replace")
    ] == []
    state = json.loads((job / "state.json").read_text())
    assert state["phase"] == "cancelled", state["phase"]
    assert {e["state"] for e in state["fleet"]["engines"]} == {"STOPPED"}
    assert state["fleet"]["final"] is True
    deadline = time.monotonic() + 15
    while (left := job_processes(job)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == []


@pytest.mark.parametrize(
    ("how", "outcome", "signame"),
    [
        ("SIGTERM", "cancelled", "SIGTERM"),
        ("SIGUSR2", "time limit", "SIGUSR2"),
        ("SIGINT", "cancelled", "SIGINT"),
    ],
)
def test_signal_unwinds_through_teardown(tmp_path: Path, how: str, outcome: str, signame: str) -> None:
    proc, job = start_job(tmp_path, f"stop-{how.lower()}")
    t0 = time.monotonic()
    proc.send_signal(signal.Signals[how])
    recorded, torn_down = wait_result(job)
    code = proc.wait(60)
    done = time.monotonic() - t0
    assert code == 128 + signal.Signals[how].value, (code, proc.stderr.read() if proc.stderr else "")
    assert_final(job, outcome, signame)
    print(
        f"\nlocal {how}: result recorded after {recorded:.2f} s, torn down and final after "
        f"{torn_down:.2f} s, driver exited after {done:.2f} s"
    )


def test_rl_launch_cancel_stops_a_local_job(tmp_path: Path) -> None:
    proc, job = start_job(tmp_path, "stop-cancel")
    t0 = time.monotonic()
    cancel = subprocess.run(
        [RL_LAUNCH, "cancel", job.name, "--root", str(tmp_path / "jobs")],
        capture_output=True,
        text=True,
        timeout=90,
    )
    took = time.monotonic() - t0
    assert cancel.returncode == 0, cancel.stderr
    assert "cancelled: cancelled by SIGTERM (exit 143)" in cancel.stdout
    assert proc.wait(30) == 143
    assert_final(job, "cancelled", "SIGTERM")
    again = subprocess.run(
        [RL_LAUNCH, "cancel", job.name, "--root", str(tmp_path / "jobs")], capture_output=True, text=True
    )
    assert again.returncode == 0 and "has already ended (cancelled" in again.stdout  # not an error
    listing = json.loads(
        subprocess.run(
            [RL_LAUNCH, "list", "--json", "--root", str(tmp_path / "jobs")], capture_output=True, text=True
        ).stdout
    )
    assert [(r["job"], r["phase"], r["exit_code"]) for r in listing] == [(job.name, "cancelled", 143)]
    print(f"\nlocal rl-launch cancel: returned with the result after {took:.2f} s")


def test_cancel_refuses_a_pid_that_is_not_the_driver(tmp_path: Path) -> None:
    """A driver that died without a word left its pid in the state; the pid may be anyone's now (here,
    this test's own process, with another start time). It is never signalled: the driver counts as gone,
    and ``cancel`` ends only the job's own processes (none here: none carries its job directory) and
    records the job cancelled (issue 38 finding 12; before, it answered "is not running", exit 1)."""
    from launcher.jobdir import JobDir, StateWriter

    job = JobDir(tmp_path / "jobs" / "gone-local-1-1").create()
    StateWriter(job).event("training", "", driver_pid=os.getpid(), driver_start_ticks=1)
    out = subprocess.run(
        [RL_LAUNCH, "cancel", job.path.name, "--root", str(tmp_path / "jobs")], capture_output=True, text=True
    )
    assert out.returncode == 0 and "nothing of it was running any more" in out.stdout, out.stdout + out.stderr
    assert job.read_result() is not None and job.read_result().outcome == "cancelled"
