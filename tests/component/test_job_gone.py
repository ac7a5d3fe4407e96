"""A job whose driver is gone without recording a result shows as lost, and ``rl-launch cancel`` ends what
it left and records it cancelled: the pieces without a whole local job (``tests/local/test_driver_sigkill.py``
runs the real one). Processes stand in for the job's: started with the job's ``RL_LAUNCH_JOB_DIR`` as the
driver starts its steps, in sessions of their own."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli.main import main
from launcher.jobdir import JobDir, StateWriter, start_ticks
from launcher.jobdir.leftovers import JOB_DIR_ENV, find


def job_with_driver(root: Path, name: str, pid: int) -> JobDir:
    job = JobDir(root / f"{name}-local-20261205-000000-{pid}").create()
    StateWriter(job).event(
        "training",
        "running",
        driver_pid=pid,
        driver_start_ticks=start_ticks(pid),
        driver_host=socket.gethostname(),
    )
    return job


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def test_a_driver_that_exited_but_was_not_collected_is_gone(tmp_path: Path, spawned: list) -> None:
    """A SIGKILLed ``rl-launch submit`` whose parent has not waited for it is a zombie: its pid and start
    time read as before, and ``list``/``status`` took it for running."""
    driver = subprocess.Popen(["sleep", "30"])
    spawned.append(driver)
    job = job_with_driver(tmp_path / "jobs", "zombie", driver.pid)
    os.kill(driver.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{driver.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert job.driver_alive() is False  # not collected: still a zombie
    out = CliRunner().invoke(main, ["list", "--json", "--root", str(tmp_path / "jobs")])
    (row,) = json.loads(out.output)
    assert row["phase"] == "lost" and f"its driver (pid {driver.pid}) is gone" in row["detail"], row
    status = CliRunner().invoke(main, ["status", job.path.name, "--json", "--root", str(tmp_path / "jobs")])
    assert json.loads(status.output)["job"]["phase"] == "lost"


def test_cancel_ends_the_sessions_the_job_left_and_nothing_else(tmp_path: Path, spawned: list) -> None:
    root = tmp_path / "jobs"
    driver = subprocess.Popen(["true"])
    driver.wait()
    job = job_with_driver(root, "left", driver.pid)
    other = tmp_path / "jobs" / "other-local-20261205-000000-1"
    mine = dict(os.environ, **{JOB_DIR_ENV: str(job.path)})
    # a step's session: its leader names the job; one member cleared its environment
    step = subprocess.Popen(
        ["bash", "-c", f"env -u {JOB_DIR_ENV} sleep 60 & exec sleep 60"], env=mine, start_new_session=True
    )
    stranger = subprocess.Popen(["sleep", "60"], env=dict(os.environ, **{JOB_DIR_ENV: str(other)}))
    plain = subprocess.Popen(["sleep", "60"])  # a process of the caller's that is no job's
    spawned += [step, stranger, plain]
    deadline = time.monotonic() + 10
    while len(find(job.path)) < 2:
        assert time.monotonic() < deadline, find(job.path)
        time.sleep(0.05)
    found = {p.pid for p in find(job.path)}
    assert step.pid in found and stranger.pid not in found and plain.pid not in found
    out = CliRunner().invoke(main, ["cancel", job.path.name, "--root", str(root)])
    assert out.exit_code == 0, out.output
    assert f"its driver (pid {driver.pid}) was gone" in out.output and "ended 2 process(es)" in out.output
    assert find(job.path) == [] and step.wait(5) is not None
    assert stranger.poll() is None and plain.poll() is None
    row = json.loads(CliRunner().invoke(main, ["list", "--json", "--root", str(root)]).output)[0]
    assert row["phase"] == "cancelled" and "last phase training" in row["detail"], row
    assert job.read_state()["phase"] == "cancelled" and job.read_result().torn_down
    again = CliRunner().invoke(main, ["cancel", job.path.name, "--root", str(root)])
    assert again.exit_code == 0 and "has already ended (cancelled" in again.output
    nothing = job_with_driver(root, "nothing", driver.pid)
    out = CliRunner().invoke(main, ["cancel", nothing.path.name, "--root", str(root)])
    assert out.exit_code == 0 and "nothing of it was running any more" in out.output, out.output


def test_fleet_down_of_a_local_fleet_whose_driver_is_gone_ends_what_it_left(
    tmp_path: Path, spawned: list
) -> None:
    """``fleet down NAME`` of a local standing fleet whose driver (and reapers) died: its engines would
    serve on with nobody to end them; it ends them, records the fleet ended, removes the record."""
    from launcher.fleet import standing

    root = tmp_path / "jobs"
    driver = subprocess.Popen(["true"])
    driver.wait()
    job = job_with_driver(root, "prod", driver.pid)
    standing.write_record(root, standing.new_record("prod", job.path, "local", "sim-8b", None))
    engine = subprocess.Popen(
        ["sleep", "60"], env=dict(os.environ, **{JOB_DIR_ENV: str(job.path)}), start_new_session=True
    )
    spawned.append(engine)
    out = CliRunner().invoke(main, ["fleet", "down", "prod", "--root", str(root)])
    assert out.exit_code == 0, out.output
    assert "rl-launch fleet down ended 1 process(es)" in out.output and "record is removed" in out.output
    assert engine.wait(5) is not None and job.read_result().outcome == "cancelled"
    assert standing.read_record(root, "prod") is None
