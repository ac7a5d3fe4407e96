"""``rl-launch list`` in a terminal of 80, 120 and 160 columns, and piped with ``COLUMNS``: every job id
whole (it is what ``status``, ``logs`` and ``cancel`` take), every phase whole, no line wider than the
terminal, and a detail (a lost job's "rl-launch cancel X ends what it left", Slurm's ``PENDING
(Resources)``) shown in full. Before, a 160-column pane showed phases as "…", ids cut after 36 characters
and the detail column at zero width; piped, the table was drawn at 200 columns whatever ``COLUMNS`` said.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli.main import main
from launcher.jobdir import JobDir, JobResult, StateWriter, SubmittedJob, start_ticks

FINISHED = "local-sim-local-20261205-030127-13447"
LOST = "grpo-qwen3-8b-math-reasoning-long-context-sweep-local-20261205-030127-25329"
QUEUED = "nemo-rl-qwen3-32b-dapo-multi-node-1234567"
RUNNING = "elastic-grpo-with-a-rather-long-experiment-name-local-20261205-091500-4242"
FLEET = "lora-fleet-local-20261205-080000-777"
IDS = (FINISHED, LOST, QUEUED, RUNNING, FLEET)


def job_root(root: Path) -> Path:
    """Five jobs as a shared root holds them: finished, lost (its driver gone), queued on Slurm, running
    (this process stands in for its driver), and a standing fleet."""
    t = time.time() - 3600
    done = JobDir(root / FINISHED).create()
    StateWriter(done).event(
        "finished",
        "training finished",
        router_url="http://127.0.0.1:20447",
        front="router (cache_aware)",
        engines="4 sim",
    )
    done.write_result(JobResult(0, "training finished", "finished", t=t))

    gone = JobDir(root / LOST).create()
    StateWriter(gone).event(
        "fleet_serving",
        "training command running",
        driver_pid=2**22 + 1,  # above pid_max on this kind of machine: no such process
        driver_start_ticks=1,
        driver_host=socket.gethostname(),
        router_url="http://127.0.0.1:20533",
        front="router (cache_aware)",
        engines="8 vllm TP2",
    )

    queued = JobDir(root / QUEUED).create()
    queued.write_submitted(
        SubmittedJob(
            job_id="1234567",
            name="nemo-rl-qwen3-32b-dapo-multi-node",
            cluster="slurm",
            t=t,
            front="router (cache_aware)",
            engines="16 vllm TP4",
        )
    )

    running = JobDir(root / RUNNING).create()
    StateWriter(running).event(
        "training",
        "training command running",
        driver_pid=os.getpid(),
        driver_start_ticks=start_ticks(os.getpid()),
        driver_host=socket.gethostname(),
        router_url="http://127.0.0.1:20601",
        front="router (least_loaded)",
        engines="2-8 sim (elastic)",
    )

    fleet = JobDir(root / FLEET).create()
    StateWriter(fleet).event(
        "fleet_serving",
        "serving",
        driver_pid=os.getpid(),
        driver_start_ticks=start_ticks(os.getpid()),
        driver_host=socket.gethostname(),
        router_url="http://127.0.0.1:20700",
        fleet_record={"name": "lora-fleet"},
        front="router (cache_aware)",
        engines="2 sim",
    )
    return root


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr("launcher.cli.jobs.slurm_state", lambda job_id: "PENDING (Resources)")
    return job_root(tmp_path / "jobs")


def listed(root: Path, columns: int) -> str:
    out = CliRunner().invoke(main, ["list", "--root", str(root)], env={"COLUMNS": str(columns)})
    assert out.exit_code == 0, out.output
    return out.stdout


@pytest.mark.parametrize("columns", [80, 120, 160])
def test_list_fits_the_terminal_with_every_id_and_phase_whole(root: Path, columns: int) -> None:
    text = listed(root, columns)
    lines = text.splitlines()
    too_wide = [line for line in lines if len(line) > columns]
    assert not too_wide, f"wider than {columns}:\n" + "\n".join(too_wide)
    assert "…" not in text, text
    words = text.split()
    for job_id in IDS:
        assert job_id in words, f"{job_id} not whole at {columns} columns:\n{text}"
    for phase in ("finished", "lost", "queued", "training", "fleet_serving"):
        assert phase in words, f"phase {phase} not whole at {columns} columns:\n{text}"


@pytest.mark.parametrize("columns", [80, 120, 160])
def test_details_are_shown_in_full(root: Path, columns: int) -> None:
    """The lost job's sentence ends with the commands to run; Slurm's reason says why it waits."""
    text = listed(root, columns)
    flat = " ".join(text.split())
    assert f"rl-launch logs {LOST} shows how far it got" in flat, text
    assert "PENDING (Resources)" in flat, text


def test_wide_terminal_shows_every_column(root: Path) -> None:
    text = listed(root, 300)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["job", "slurm", "phase"], text
    for column in ("detail", "fleet", "front", "engines", "router", "updated"):
        assert column in lines[0].split(), text
    line = next(line for line in lines if line.startswith(FINISHED))
    assert "finished" in line and "http://127.0.0.1:20447" in line and "training finished" in line, text


def test_without_columns_piped_each_job_is_one_line(root: Path) -> None:
    """Piped with no ``COLUMNS`` (``rl-launch list | grep``): no width to fit, every job on one line."""
    out = CliRunner().invoke(main, ["list", "--root", str(root)], env={"COLUMNS": None})
    lines = out.stdout.splitlines()
    assert len(lines) == 1 + len(IDS), out.stdout
    assert f"rl-launch logs {LOST} shows how far it got" in next(x for x in lines if x.startswith(LOST))


def test_narrow_terminal_keeps_ids_and_phases_and_drops_the_rest(root: Path) -> None:
    """Too narrow for an id and its phase side by side: each job keeps its id on a line of its own."""
    text = listed(root, 60)
    words = text.split()
    for job_id in IDS:
        assert job_id in words, text
    assert all(len(line) <= 60 or line.strip() in IDS for line in text.splitlines()), text


def test_json_is_unchanged_by_the_width(root: Path) -> None:
    narrow = CliRunner().invoke(main, ["list", "--json", "--root", str(root)], env={"COLUMNS": "80"})
    wide = CliRunner().invoke(main, ["list", "--json", "--root", str(root)], env={"COLUMNS": "200"})
    rows = json.loads(narrow.stdout)
    assert sorted(r["job"] for r in rows) == sorted(IDS)
    assert narrow.stdout == wide.stdout
    by_job = {r["job"]: r for r in rows}
    assert by_job[LOST]["phase"] == "lost" and by_job[QUEUED]["slurm"] == "PENDING (Resources)"


def test_a_failures_log_lines_stay_lines(tmp_path: Path) -> None:
    """A training failure's reason carries its log's last lines (``launcher.driver.training``): each keeps
    a line of its own under the job, and piped without ``COLUMNS`` the job stays one line."""
    root = tmp_path / "jobs"
    job = JobDir(root / "exits-at-once-local-20261205-112656-29421").create()
    reason = (
        f"training command exited with 2 (log: {job.training_log})\n  usage: train.py [-h] [--steps STEPS]\n"
        "  train.py: error: unrecognized arguments: --epochs 4"
    )
    StateWriter(job).event("failed", reason)
    job.write_result(JobResult(2, reason, "failed"))
    lines = listed(root, 120).splitlines()
    assert "    usage: train.py [-h] [--steps STEPS]" in lines, lines
    assert "    train.py: error: unrecognized arguments: --epochs 4" in lines, lines
    piped = CliRunner().invoke(main, ["list", "--root", str(root)], env={"COLUMNS": None}).stdout.splitlines()
    assert len(piped) == 2 and piped[1].endswith("| train.py: error: unrecognized arguments: --epochs 4"), (
        piped
    )
