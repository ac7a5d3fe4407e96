"""``rl-launch cancel`` of a job that has already ended says so, with how it ended, and exits 0: what the
user asked for holds (the job does not run). Before, it exited 1 ("Error: ... has already ended"), which
a script cancelling its jobs on the way out took for a failure."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from launcher.cli.main import main
from launcher.jobdir import JobDir, JobResult, StateWriter


def test_cancel_of_an_ended_job_says_so_and_exits_0(tmp_path: Path) -> None:
    root = tmp_path / "jobs"
    job = JobDir(root / "done-local-20261205-000000-1").create()
    StateWriter(job).event("finished", "training finished")
    job.write_result(JobResult(0, "training finished", "finished"))
    out = CliRunner().invoke(main, ["cancel", job.path.name, "--root", str(root)])
    assert out.exit_code == 0, out.output
    assert out.output == f"{job.path.name} has already ended (finished: training finished, exit 0)\n"
    assert job.read_result() == JobResult(0, "training finished", "finished")  # nothing rewritten


def test_cancel_of_a_failed_job_names_its_failure(tmp_path: Path) -> None:
    root = tmp_path / "jobs"
    job = JobDir(root / "bad-local-20261205-000000-2").create()
    StateWriter(job).event("failed", "training command exited with 2")
    job.write_result(JobResult(2, "training command exited with 2", "failed"))
    out = CliRunner().invoke(main, ["cancel", job.path.name, "--root", str(root)])
    assert out.exit_code == 0, out.output
    assert "has already ended (failed: training command exited with 2, exit 2)" in out.output


def test_cancel_timeout_has_help() -> None:
    out = CliRunner().invoke(main, ["cancel", "--help"])
    assert "Seconds to wait for the job's result" in " ".join(out.output.split())
