"""Late failures of a local job say what happened and what to look at, the way a user runs it
(``rl-launch submit``, real Ray, simulated engines, the real router):

* a training command that exits at once: the failure line carries its log's last lines and the log's
  path (before: "failed: training command exited with 2 (exit 2)", the cause only in the training log);
* a job that fails before its training command started says nothing of stopping it (before:
  "teardown: training stopped in 0.0 s" all the same), and the teardown's lines, said from parallel
  threads, each stay a line of their own;
* ``rl-launch cancel``: the submit's terminal does not end with "Ray did not disconnect; exiting without
  its exit hooks", which a hurried teardown makes the rule (the driver log keeps it).
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import RL_LAUNCH
from tests.support.jobs import start_job
from tests.support.specs import local_spec, run_spec, sim, trainer_command

pytestmark = pytest.mark.ray


def driver_lines_whole(stderr: str) -> None:
    joined = [line for line in stderr.splitlines() if "[rl-launch " in line[1:]]
    assert not joined, joined


TRAINER = """\
import argparse
parser = argparse.ArgumentParser(prog="train.py")
parser.add_argument("--steps", type=int)
parser.parse_args()
"""


def test_a_training_command_that_exits_at_once_names_its_cause(tmp_path: Path) -> None:
    command = trainer_command(tmp_path, TRAINER, "--epochs", "4")  # not a flag of its: argparse exits 2
    spec = local_spec("exits-at-once", root=tmp_path / "jobs", command=command, generation=sim(2))
    proc, job = run_spec(tmp_path / "spec.yaml", spec, timeout=300)
    assert proc.returncode == 2, proc.stderr
    log = job / "logs" / "training.log"
    lines = proc.stderr.splitlines()
    at = next(i for i, line in enumerate(lines) if "] failed: training command exited with 2" in line)
    assert lines[at].endswith(f"failed: training command exited with 2 (log: {log}) (exit 2)"), proc.stderr
    why = "train.py: error: unrecognized arguments: --epochs 4"
    assert f"  {why}" in lines[at + 1 : at + 4], proc.stderr
    result = json.loads((job / "result.json").read_text())
    assert why in result["reason"] and result["exit_code"] == 2
    driver_lines_whole(proc.stderr)
    (row,) = json.loads(
        subprocess.run(
            [RL_LAUNCH, "list", "--json", "--root", str(tmp_path / "jobs")], capture_output=True
        ).stdout.decode()
    )
    assert why in row["detail"], row


def test_a_job_failing_before_training_does_not_stop_a_training_it_never_started(tmp_path: Path) -> None:
    taken = socket.socket()  # the router's only port, bound by someone else (outside the ephemeral range)
    for port in range(21500, 22000):
        try:
            taken.bind(("127.0.0.1", port))
            break
        except OSError:
            continue
    try:
        spec = local_spec(
            "no-port",
            root=tmp_path / "jobs",
            command="sleep 600",
            generation=sim(2),
            router={"port_range": [port, port]},
        )
        proc, _ = run_spec(tmp_path / "spec.yaml", spec, timeout=300)
    finally:
        taken.close()
    assert proc.returncode == 1, proc.stderr
    assert f"no free port in the router port range {port}-{port}" in proc.stderr, proc.stderr
    assert "teardown: ray-head stopped" in proc.stderr, proc.stderr
    assert "teardown: training stopped" not in proc.stderr, proc.stderr
    driver_lines_whole(proc.stderr)


def test_cancel_ends_the_submit_without_a_ray_warning(tmp_path: Path) -> None:
    proc, job = start_job(tmp_path, "cancelled-quietly")
    cancel = subprocess.run(
        [RL_LAUNCH, "cancel", job.name, "--root", str(tmp_path / "jobs")], capture_output=True, text=True
    )
    assert cancel.returncode == 0, cancel.stderr
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    assert "Ray did not disconnect" not in stderr, stderr
    assert "cancelled by SIGTERM: tearing down" in stderr
    driver_lines_whole(stderr)
    said = (job / "driver.log").read_text()
    print("driver log says Ray did not disconnect:", "Ray did not disconnect" in said)
