"""``rl-launch submit --follow`` prints each of the driver's events whole and as text.

Piped into a log (how a batch user reads it), rich wrapped each event at 80 columns, and it read an event's
detail as markup: a ``[node1]`` in an error message vanished from what the user saw. ``job_state`` (squeue
and sacct) is replaced here by a fixed answer; the Slurm tier runs ``--follow`` against a real controller.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.jobdir import JobDir
from launcher.jobdir.records import JobResult
from launcher.submit import job as submit_job


def test_follow_prints_each_event_on_one_line_with_its_brackets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    jdir = JobDir(tmp_path / "job")
    jdir.path.mkdir(parents=True)
    detail = "[node1] engine 0 exited 1: " + "; ".join(["RuntimeError: out of memory on the device"] * 6)
    jdir.log_event("engines_failed", detail)
    jdir.write_result(JobResult(exit_code=1, reason="an engine failed"))
    monkeypatch.setattr(submit_job, "job_state", lambda job_id: "FAILED")

    assert submit_job.follow_job("42", jdir.path, poll_s=0.01, timeout_s=5) == 1

    lines = capsys.readouterr().err.splitlines()
    assert f"engines_failed {detail}" in lines, lines
    assert lines[-1] == "job 42 FAILED: exit 1"
