"""The README's first two commands stay true (as submitit's test_documentation keeps its docs honest).

The first command's job, ``rl-launch submit examples/local.yaml``, is run for real (the install part is
what made this test environment); the second must be exactly what CI runs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "README.md must start with a bash block of commands"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_starts_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    head = text[: text.index("```bash")]
    # the title, then the one-paragraph description a new user reads first, then the commands
    assert head.startswith("# rl-launch\n\nrl-launch is a Slurm-native launcher"), head[:200]
    assert head.strip().count("\n\n") == 1, "one paragraph between the title and the commands"
    install_and_run, tests = readme_commands()[:2]
    assert "pip install -e '.[dev]'" in install_and_run
    assert "rl-launch submit examples/local.yaml" in install_and_run
    assert tests == ".venv/bin/python -m pytest -q"
    ci = (ROOT / ".ci" / "pytest-in-cluster.sh").read_text()
    assert "exec .venv/bin/python -m pytest -q" in ci, "CI must run the README's test command"
    assert ".ci/pytest-in-cluster.sh" in (ROOT / ".ci" / "run").read_text()


def test_readme_first_command_runs_the_local_job() -> None:
    first = readme_commands()[0]
    job = first.split("&&")[-1].strip()
    assert job.startswith(".venv/bin/rl-launch submit")
    rl_launch = str(Path(sys.executable).with_name("rl-launch"))
    proc = subprocess.run(
        [rl_launch, *job.split()[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "rollout replay" in out and "cache_aware" in out
    assert "router serving http://127.0.0.1:" in out
    assert re.search(r"finished: training finished \(exit 0\)", out), out[-2000:]
    # the job's outputs are in its job directory (under the session's $HOME, see conftest), never in
    # the directory it was started from
    jobs = list((Path(os.environ["HOME"]) / "rl-launch" / "jobs").glob("local-sim-*"))
    assert len(jobs) == 1 and (jobs[0] / "replay.json").is_file(), jobs
    # the replay's per-engine figures come from the job directory's listings (the router's /workers
    # needs the admin token, which a trainer does not hold)
    replay = json.loads((jobs[0] / "replay.json").read_text())
    assert replay["config"]["engines"] == 4, replay["config"]
    assert "4 engines" in out
    assert not (ROOT / "bench" / "results").exists()
