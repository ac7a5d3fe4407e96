"""What the spec needs of the machine it is checked on: files that must exist, the environment the
engines inherit, what a container must mount. The schema and the rules judge the spec's text alone; these
judge it against this machine, so a job that would fail minutes in (after Ray and the engines started, or
after a queue wait) fails at ``validate`` instead.

Each check is an error where this machine is where the job runs (``cluster: local``), and a warning where
the site can make it right out of this machine's sight (``cluster: slurm``: the login node may not see a
model directory the compute nodes see; a site's enroot/pyxis configuration may mount directories by
default; ``rl-launch check SPEC`` looks from a node). The refit switch is always a warning: a job that
never refits, or an image that sets it, is right without it.

``validate``, ``render``, ``submit`` and ``fleet up`` run them (``Machine.here()``); the driver inside an
allocation does not (another node, another directory), nor does ``validate --spec-only``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.engines.kinds import engine_kind
from launcher.engines.vllm.kind import VllmSettings
from launcher.gateways.kinds import front_kind
from launcher.spec.errors import Issue

if TYPE_CHECKING:
    from launcher.spec.job import JobSpec

DEV_MODE = "VLLM_SERVER_DEV_MODE"
"""vLLM 0.32 serves the routes a refit drives (pause, reload, resume) only with this set to 1."""
_TRUE = {"1", "ON", "YES", "TRUE"}
"""How huggingface_hub reads a boolean variable (``HF_HUB_OFFLINE``)."""
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_SCRIPT = re.compile(r"[^-$=][^$=]*\.(py|sh|bash)")
_OPERATORS = {";", "&&", "||", "|", "&", "(", ")"}
_SYSTEM_PREFIXES = (Path("/usr"), Path("/usr/local"))


@dataclasses.dataclass(frozen=True)
class Machine:
    """The machine a spec is checked on: where commands run from, the environment jobs inherit, and
    where rl-launch is installed (the batch script runs ``<prefix>/bin/rl-launch``)."""

    cwd: Path
    environ: Mapping[str, str]
    prefix: Path
    base_prefix: Path

    @classmethod
    def here(cls) -> Machine:
        return cls(Path.cwd(), dict(os.environ), Path(os.path.abspath(sys.prefix)), Path(sys.base_prefix))


def machine_issues(spec: JobSpec, machine: Machine) -> list[Issue]:
    """Every problem of ``spec`` on ``machine`` (errors and warnings, see the module docstring)."""
    issues = _training_script(spec, machine)
    gen = spec.generation
    if gen.fleet is None and gen.owner == "launcher" and VllmSettings in engine_kind(gen.engine).settings:
        issues += _no_vllm(spec, machine)
        issues += _model(spec, machine)
        issues += _dev_mode(spec, machine)
    issues += _container_mounts(spec, machine)
    return issues


def _no_vllm(spec: JobSpec, machine: Machine) -> list[Issue]:
    """vLLM engines of a local job on a machine without vLLM (``launcher.engines.vllm.presence``); on
    Slurm the nodes run them (``rl-launch check`` looks there)."""
    from launcher.engines.vllm.kind import VllmKind
    from launcher.engines.vllm.presence import no_vllm_here

    if spec.cluster != "local" or not isinstance(engine_kind(spec.generation.engine), VllmKind):
        return []  # Dynamo's vLLM workers run from its own environment
    why = no_vllm_here({**machine.environ, **spec.generation.env})
    return [Issue("generation.engine", why)] if why else []


def _script_of(command: str) -> str | None:
    """The script the training command's first command runs (``python examples/grpo/train.py ...``:
    ``examples/grpo/train.py``), if it names one by a plain path (no variable in it)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:  # unbalanced quotes: bash will say so
        return None
    for word in words:
        if word in _OPERATORS:
            return None
        if _SCRIPT.fullmatch(word):
            return word
    return None


def _spec_dir_hint(spec: JobSpec, script: str) -> str:
    """Where the script is after all, said as the fix: the spec's directory or one above it."""
    if spec.source is None:
        return "; check the path, or make it absolute"
    spec_dir = spec.source.parent
    for base in (spec_dir, *spec_dir.parents):
        found = base / script
        if found.exists():
            rel = os.path.relpath(found, spec_dir)
            return f': submit from {base}, or write it as "${{spec_dir}}/{rel}" (the spec file\'s directory)'
    return '; check the path, or make it absolute ("${spec_dir}/..." is the spec file\'s directory)'


def _training_script(spec: JobSpec, machine: Machine) -> list[Issue]:
    """A script the training command runs by a path that does not exist from where it will run: the
    directory ``submit`` runs in (the driver starts the command there; sbatch starts the job there). In a
    container the image may hold it (its own working directory, or ``workdir``): not checked."""
    if spec.training is None:
        return []
    script = _script_of(spec.training.command)
    container = spec.slurm.container if spec.cluster == "slurm" else None
    if script is None or container is not None:
        return []
    path = Path(os.path.expanduser(script))
    if (machine.cwd / path).exists():
        return []
    where = (
        ""
        if path.is_absolute()
        else f" from {machine.cwd} (the command runs in the directory you submit from)"
    )
    return [
        Issue(
            "training.command",
            f"runs {script}, which does not exist{where}{_spec_dir_hint(spec, script)}",
            warning=spec.cluster == "slurm",
        )
    ]


def _hub_cache(env: Mapping[str, str]) -> Path:
    """The Hugging Face hub cache the engines read (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub`` or ``~/.cache/huggingface/hub``)."""
    if env.get("HF_HUB_CACHE"):
        return Path(os.path.expanduser(env["HF_HUB_CACHE"]))
    if env.get("HF_HOME"):
        return Path(os.path.expanduser(env["HF_HOME"])) / "hub"
    cache = env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "huggingface" / "hub"


def _model(spec: JobSpec, machine: Machine) -> list[Issue]:
    """The model directory that is not there, or a hub id the engines cannot download: they run with
    ``HF_HUB_OFFLINE=1`` unless told otherwise (a compute node's Hub lookup hangs instead of failing),
    so a hub id must already be in the Hub cache."""
    model = spec.generation.model
    if not model:
        return []
    env = {**machine.environ, **spec.generation.env}  # the engines' environment: the job's, then the spec's
    path = Path(os.path.expanduser(model))
    if (machine.cwd / path).exists():
        return []
    slurm = spec.cluster == "slurm"
    looks_like_path = model.startswith(("/", "./", "../", "~")) or model.count("/") > 1
    if looks_like_path or not _HUB_ID.fullmatch(model):
        rel = "" if path.is_absolute() else f" (relative to the directory you submit from, {machine.cwd})"
        fix = (
            "it must be on storage the generation nodes see (rl-launch check SPEC looks from a node)"
            if slurm
            else "make or download the model there, or set generation.model to a model directory"
        )
        return [
            Issue("generation.model", f"{model} does not exist on this machine{rel}: {fix}", warning=slurm)
        ]
    if env.get("HF_HUB_OFFLINE", "1").strip().upper() not in _TRUE:
        return []
    cache = _hub_cache(env)
    snapshots = cache / f"models--{model.replace('/', '--')}" / "snapshots"
    if snapshots.is_dir() and any(snapshots.iterdir()):
        return []
    shared = " on storage every node sees" if slurm else ""
    return [
        Issue(
            "generation.model",
            f"{model!r} is a Hugging Face id, the engines run offline (HF_HUB_OFFLINE=1 unless "
            f"generation.env sets it) and this machine's Hub cache ({cache}) has no copy: download it first, "
            f"`hf download {model} --local-dir DIR`{shared}, and set model: DIR",
            warning=slurm,
        )
    ]


def _dev_mode(spec: JobSpec, machine: Machine) -> list[Issue]:
    """vLLM engines behind a front with the refit routes, without ``VLLM_SERVER_DEV_MODE``: the first
    refit fails (vLLM answers 404 on its reload and pause routes) after the queue wait and the engines'
    start. Set in the submitting shell it counts too: the engine hosts inherit the driver's environment,
    which is the shell's (Slurm passes it on). ``"0"`` in ``generation.env`` says the job never refits."""
    if not front_kind(spec.router.kind).has_fleet_routes:
        return []
    if DEV_MODE in spec.generation.env or machine.environ.get(DEV_MODE) == "1":
        return []
    return [
        Issue(
            "generation.env",
            f'has no {DEV_MODE}: "1", and vLLM serves the routes a refit drives (FleetClient.load_weights, '
            f'rl-launch fleet refit, the control API) only with it: add it, or {DEV_MODE}: "0" if this job '
            "never refits",
            warning=True,
        )
    ]


def _mounted(path: Path, mounts: list[str]) -> bool:
    """Whether ``path`` is inside a mount that shows it at the same path in the container."""
    for mount in mounts:
        src, dst = (os.path.normpath(p) for p in mount.split(":")[:2])
        if src == dst and (path == Path(src) or Path(src) in path.parents):
            return True
    return False


def _container_mounts(spec: JobSpec, machine: Machine) -> list[Issue]:
    """What the job's steps run or write in the container, at the paths the batch script names: the
    launcher's install (``<prefix>/bin/rl-launch``) and the Python it is a venv of (a system Python is
    left alone: the image has its own, which cannot be compared from here), the spec file the driver
    reads, the job root it writes."""
    container = spec.slurm.container if spec.cluster == "slurm" else None
    if container is None:
        return []
    needed = [
        (machine.prefix, f"the launcher's install: the batch script runs {machine.prefix}/bin/rl-launch")
    ]
    base = machine.base_prefix
    if base != machine.prefix and not any(base == p or p in base.parents for p in _SYSTEM_PREFIXES):
        needed.append((base, "the Python the launcher's venv is made from"))
    needed.append((Path(os.path.abspath(os.path.expanduser(spec.job_root))), "job_root: the job's directory"))
    if spec.source is not None:
        needed.append((spec.source, "the spec file the driver reads"))
    issues = []
    for path, what in needed:
        if _mounted(path, container.mounts):
            continue
        top = Path(*path.parts[:2])
        issues.append(
            Issue(
                "slurm.container.mounts",
                f"the container does not see {path} ({what}): add '{top}:{top}' (or any directory above "
                f"it) to the mounts, unless your site's enroot/pyxis mounts it by default",
                warning=True,
            )
        )
    return issues
