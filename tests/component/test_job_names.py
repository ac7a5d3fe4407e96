"""A job is found by its name too (the spec's ``name``: a standing fleet's name among them), by the one
lookup every command shares; ids and directory names keep their meaning, and the newest job of a name is
the one the name means. Job directories written the way the driver and ``fleet up`` write them."""

from __future__ import annotations

import json
import time
from pathlib import Path

from click.testing import CliRunner

from launcher.cli.main import main
from launcher.jobdir import JobDir, JobResult, StateWriter, SubmittedJob
from launcher.jobdir.lookup import find_job, job_name


def fleet_dir(root: Path, name: str, stamp: str) -> JobDir:
    """A local standing fleet's directory as ``fleet up`` makes it (``<name>-local-<time>-<pid>``)."""
    job = JobDir(root / f"{name}-local-{stamp}-4242").create()
    job.write_submitted(
        SubmittedJob(job_id="", name=name, cluster="local", t=time.time(), job_dir=str(job.path))
    )
    StateWriter(job).event("fleet_serving", f"standing fleet {name!r} serving")
    return job


def test_a_fleet_name_finds_the_newest_fleet_of_that_name(tmp_path: Path) -> None:
    root = tmp_path / "jobs"
    old = fleet_dir(root, "lora-fleet", "20261205-010000")
    old.write_result(JobResult(0, "brought down", "finished"))
    time.sleep(0.01)
    new = fleet_dir(root, "lora-fleet", "20261205-020000")
    other = JobDir(root / "lora-fleet2-local-20261205-030000-7").create()  # a longer name is another job
    StateWriter(other).event("training", "running")
    assert job_name(new.path) == "lora-fleet" and job_name(other.path) == "lora-fleet2"
    assert find_job("lora-fleet", root) == new.path
    assert find_job(old.path.name, root) == old.path  # a directory name still names that one
    out = CliRunner().invoke(main, ["status", "lora-fleet", "--json", "--root", str(root)])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["job"]["dir"] == str(new.path)
    for command in (["logs", "lora-fleet"], ["fleet", "version", "lora-fleet"]):
        res = CliRunner().invoke(main, [*command, "--root", str(root)])
        assert "no job 'lora-fleet'" not in res.output, (command, res.output)


def test_a_local_job_without_submitted_json_is_found_by_the_name_in_its_directory(tmp_path: Path) -> None:
    root = tmp_path / "jobs"
    job = JobDir(root / "local-sim-local-20261205-030127-13447").create()  # rl-launch submit, local
    StateWriter(job).event("training", "running")
    assert find_job("local-sim", root) == job.path
    missing = CliRunner().invoke(main, ["status", "local", "--json", "--root", str(root)])
    assert missing.exit_code == 1 and "no job 'local'" in missing.output, missing.output
