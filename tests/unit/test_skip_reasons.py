"""A skipped tier says how to install what it lacks, all of it at once (the README's test command has
``-rs``, so these reasons are what a newcomer reads).

The Dynamo tests need the Dynamo venv, etcd and NATS, and the tiny model built by the vLLM python: their
reason must name every missing part, not the first fixture's (a newcomer saw only "RL_LAUNCH_VLLM_PYTHON
is not set", installed vLLM, and met a second skip). Run as a user runs it: pytest in a subprocess, in an
environment without either python.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dynamo_tests_name_every_missing_part_with_its_install_command(tmp_path: Path) -> None:
    drop = (
        "RL_LAUNCH_VLLM_PYTHON",
        "RL_LAUNCH_DYNAMO_PYTHON",
        "RL_LAUNCH_REQUIRE_ALL",
        "PYTEST_XDIST_WORKER",
    )
    env = {k: v for k, v in os.environ.items() if k not in drop}
    argv = [sys.executable, "-m", "pytest", "-n", "0", "-q", "-rs", "-p", "no:cacheprovider"]
    argv += ["--basetemp", str(tmp_path / "t"), "tests/dynamo/test_dynamo_local.py"]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    skips = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    assert proc.returncode == 0 and skips, proc.stdout[-3000:]
    assert sum(int(re.search(r"\[(\d+)\]", s).group(1)) for s in skips) == 5, skips  # type: ignore[union-attr]
    for line in skips:
        assert 'export RL_LAUNCH_DYNAMO_PYTHON="$(.ci/install-dynamo.sh)"' in line, line
        assert 'export RL_LAUNCH_VLLM_PYTHON="$(scripts/install-vllm.sh --cpu)"' in line, line
