"""The spec of a local job (``cluster: local``) as the tests write it for ``rl-launch submit`` and ``rl-launch
fleet up``: one writer instead of a near-copy of the same dict (name, cluster, job root, training command,
generation, router) in each test module that runs a job.

``local_spec`` builds the dict, ``sim`` its ``generation`` section for simulated engines, ``trainer_command``
writes a trainer script and returns the command that runs it, ``write_spec`` writes the YAML, and
``run_spec`` writes it, runs ``rl-launch submit`` to the job's end and returns the one job directory.
What differs between the tests stays in the call (names, engine counts, the sim's speed, the router), so a
spec's values read at the call site as before.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.support.cli import RL_LAUNCH


def sim(
    engines_per_node: int | None = None,
    *,
    speed: float | None = None,
    served_model_name: str | None = "sim-8b",
    **more: Any,
) -> dict[str, Any]:
    """A ``generation`` section of simulated engines (``engine: sim``): ``engines_per_node`` and
    ``sim: {speed: ...}`` only when given, ``served_model_name`` unless None, then ``more`` as it is."""
    generation: dict[str, Any] = {"engine": "sim"}
    if engines_per_node is not None:
        generation["engines_per_node"] = engines_per_node
    if served_model_name is not None:
        generation["served_model_name"] = served_model_name
    if speed is not None:
        generation["sim"] = {"speed": speed}
    return {**generation, **more}


def local_spec(
    name: str,
    *,
    root: Path | None,
    generation: dict[str, Any],
    command: str | None = None,
    **sections: Any,
) -> dict[str, Any]:
    """A ``cluster: local`` spec named ``name``: its jobs under ``root`` (None: no ``job_root``, for the
    ``running_job`` fixture, which sets its own), ``command`` its training command (None: no ``training``
    section, as a standing fleet's own spec has none), and ``sections`` (``router``, ``fleet``) as given:
    ``router=None`` writes ``router: null``, a section not given is not written."""
    spec: dict[str, Any] = {"name": name, "cluster": "local"}
    if root is not None:
        spec["job_root"] = str(root)
    if command is not None:
        spec["training"] = {"command": command}
    spec["generation"] = generation
    spec.update(sections)
    return spec


def trainer_command(directory: Path, text: str, *args: str, file: str = "trainer.py") -> str:
    """Write ``text`` to ``directory/file``; the training command that runs it with this Python and
    ``args``."""
    script = directory / file
    script.write_text(text)
    return " ".join([sys.executable, str(script), *args])


def write_spec(path: Path, spec: dict[str, Any]) -> Path:
    """Write ``spec`` to ``path`` as YAML (keys sorted, as ``yaml.safe_dump`` does); returns ``path``."""
    path.write_text(yaml.safe_dump(spec))
    return path


def run_spec(
    path: Path, spec: dict[str, Any], timeout: float
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Write ``spec`` to ``path``, run ``rl-launch submit`` on it to the job's end (within ``timeout`` s),
    and return the finished command and the one job directory under the spec's ``job_root``."""
    write_spec(path, spec)
    proc = subprocess.run([RL_LAUNCH, "submit", str(path)], capture_output=True, text=True, timeout=timeout)
    (job,) = list(Path(spec["job_root"]).iterdir())
    return proc, job
