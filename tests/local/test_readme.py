"""The README's first two commands stay true (as submitit's test_documentation keeps its docs honest).

The first command's job, ``rl-launch submit examples/local.yaml``, is run for real (the install part is
what made this test environment); the second must be exactly what CI runs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from tests.support.cli import RL_LAUNCH

ROOT = Path(__file__).resolve().parents[2]


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
    # -rs: a newcomer sees why each test skipped (the tier and how to install it), not only a count
    assert tests == ".venv/bin/python -m pytest -q -rs"
    ci = (ROOT / ".ci" / "pytest-in-cluster.sh").read_text()
    assert f"exec {tests} " in ci, "CI must run the README's test command"
    assert ".ci/pytest-in-cluster.sh" in (ROOT / ".ci" / "run").read_text()


def test_readme_first_command_runs_the_local_job() -> None:
    first = readme_commands()[0]
    job = first.split("&&")[-1].strip()
    assert job.startswith(".venv/bin/rl-launch submit")
    # the environment of the README's reader: the first line exports nothing, so CI's RL_LAUNCH_VLLM_PYTHON
    # (for the vLLM tier) must not reach the trainer, whose sim mode would then give another reason
    env = {k: v for k, v in os.environ.items() if k != "RL_LAUNCH_VLLM_PYTHON"}
    proc = subprocess.run(
        [RL_LAUNCH, *job.split()[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "cache_aware" in out and "router serving http://127.0.0.1:" in out
    assert re.search(r"finished: training finished \(exit 0\)", out), out[-2000:]
    # the example GRPO trainer's loop and refits ran: one line a step, the fleet moved to each step's
    # version, and the output says why the reward is flat (no torch, simulated text)
    assert "sim mode (no python with torch" in out
    assert all(f"grpo step {i}: reward" in out for i in range(4)), out[-3000:]
    assert "fleet on step-4" in out and "no gradient step ran" in out
    assert "simulated engines' text is a hash of the prompt" in out
    # the job's outputs are in its job directory (under the session's $HOME, see conftest), never in
    # the directory it was started from
    jobs = list((Path(os.environ["HOME"]) / "rl-launch" / "jobs").glob("local-sim-*"))
    assert len(jobs) == 1, jobs
    metrics = json.loads((jobs[0] / "grpo" / "metrics.json").read_text())
    assert metrics["mode"] == "sim" and metrics["final_version"] == "step-4"
    for step in metrics["steps"]:  # every sample came from the step's own version; each step refit
        assert step["versions_seen"] == {step["version"]: 16} and step["dropped"] == 0, step
        assert (
            step["seconds"]["refit"] > 0 and (jobs[0] / "checkpoints" / f"step-{step['step'] + 1}").is_dir()
        )
    assert [s["version"] for s in metrics["steps"]] == [f"step-{i}" for i in range(4)]
    assert (jobs[0] / "grpo" / "metrics.csv").is_file() and (jobs[0] / "grpo" / "reward.png").is_file()
    assert not (ROOT / "bench" / "results").exists()
