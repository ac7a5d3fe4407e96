"""Render a resolved spec as a standalone sbatch script (``rl-launch render``).

The script is the submit path that needs nothing but ``sbatch``: its ``#SBATCH`` header is exactly the
Slurm request (``launcher.slurm.request``; heterogeneous components included, which submitit cannot
submit), and its body calls the same driver the submitit path runs:
``rl-launch submit SPEC --in-allocation --job-dir DIR``, once, on the first node of the allocation.

Paths are frozen at render time on purpose: the spec by absolute path and ``rl-launch`` by the
executable of *this* installation (the venv's ``rl-launch`` next to ``sys.executable``, else the one on
``PATH``, else ``python -m launcher.cli``), because a batch job starts with whatever ``PATH`` the
compute node gives it, which may not have the venv the user rendered from.

Template location: ``templates/sbatch.j2`` (the project layout), installed as the package
``launcher.templates`` (``package-dir`` in pyproject.toml) and loaded with ``jinja2.PackageLoader``: it
ships in wheels, and an editable install reads it from the checkout; one copy, no path tricks.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import jinja2

from launcher import __version__
from launcher.jobdir.ownership import make_private
from launcher.slurm.request import build_request
from launcher.spec import ResolvedSpec


def rl_launch_command() -> list[str]:
    """How the batch script should call ``rl-launch`` (see the module docstring for the order)."""
    sibling = Path(sys.executable).parent / "rl-launch"  # not resolved: a venv's python is a symlink
    if sibling.is_file() and os.access(sibling, os.X_OK):
        return [str(sibling)]
    found = shutil.which("rl-launch")
    if found:
        return [os.path.abspath(found)]
    return [sys.executable, "-m", "launcher.cli"]


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("launcher.templates", "."),
        undefined=jinja2.StrictUndefined,  # a missing variable is a bug, never an empty string in a script
        autoescape=False,  # shell, not HTML: values are quoted explicitly with the q filter
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env


def render_sbatch(
    resolved: ResolvedSpec, *, rl_launch: Sequence[str] | None = None, overrides: Sequence[str] = ()
) -> str:
    """The sbatch script for ``resolved`` (a ``cluster: slurm`` spec loaded from a file).

    ``rl_launch`` overrides the command found by ``rl_launch_command`` (tests, unusual installs);
    ``overrides`` are the ``--set`` arguments the spec was resolved with, passed on to the driver so the
    job runs the spec that was rendered.
    """
    if resolved.slurm is None:
        raise ValueError(
            "cluster is 'local': there is nothing to submit to Slurm; run `rl-launch submit SPEC`"
        )
    if not resolved.spec_path:
        raise ValueError("the spec has no file path; render needs a spec loaded from a file (load_spec)")
    for what, value in (("spec path", resolved.spec_path), ("job_root", resolved.job_root)):
        if "\n" in value or "\r" in value:
            raise ValueError(f"the {what} {value!r} contains a line break; it cannot go into a script")
    request = build_request(resolved)
    command = list(rl_launch) if rl_launch is not None else rl_launch_command()
    if request.layout == "single":
        layout_note = (
            f"one allocation of {request.total_nodes} nodes; the first {resolved.training.nodes} "
            "(sorted) are training, the rest generation"
        )
        labels = [""]
    else:
        layout_note = "heterogeneous job: component 0 training, component 1 generation"
        labels = [
            f"component 0: training ({resolved.training.nodes} nodes)",
            f"component 1: generation ({resolved.generation.nodes} nodes)",
        ]
    components = [
        {"label": label, "directives": list(component.directives)}
        for label, component in zip(labels, request.components, strict=True)
    ]
    return (
        _environment()
        .get_template("sbatch.j2")
        .render(
            name=resolved.name,
            version=__version__,
            spec_path=resolved.spec_path,
            job_root=resolved.job_root,
            layout_note=layout_note,
            components=components,
            launch=request.driver_line(driver_command(command, resolved.spec_path, overrides)),
        )
    )


def driver_command(rl_launch: Sequence[str], spec_path: str, overrides: Sequence[str] = ()) -> str:
    """Shell text of the driver's command line in the batch script (``$job_dir`` set by the script)."""
    sets = [arg for o in overrides for arg in ("--set", o)]
    return f'{shlex.join([*rl_launch, "submit", spec_path, *sets])} --in-allocation --job-dir "$job_dir"'


def default_script_path(resolved: ResolvedSpec) -> Path:
    """``<job_root>/<name>.sbatch``: next to the job directories and the batch logs."""
    return Path(resolved.job_root) / f"{resolved.name}.sbatch"


def write_sbatch(
    resolved: ResolvedSpec, out: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()
) -> Path:
    """Render to ``out`` (default ``default_script_path``) and create ``job_root``, since Slurm writes
    the batch log there (``#SBATCH --output``) and silently fails a job whose log directory is missing."""
    text = render_sbatch(resolved, overrides=overrides)
    make_private(resolved.job_root)  # 0700 when made here: mkdir(parents=True) took the umask's 775
    path = Path(out) if out is not None else default_script_path(resolved)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    path.chmod(0o755)
    return path
