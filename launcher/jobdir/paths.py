"""Every path under a job directory that a package other than ``jobdir`` reads or writes, and the job
root's own entries, composed here and nowhere else.

``JobDir`` (``layout.py``) names the files the driver, the engine hosts and the login side share through
typed records; this module names the directories and files the feature packages own the *contents* of
(the request record, the elastic requests, a standing fleet's consumers, a front's own state). Before
they lived here each package spelled its own path (``job / "record"`` twice, ``"engines" / "serve"`` in two
modules of one front), so a rename in one place silently split a reader from its writer. These take the
path as given (no ``resolve()``): the caller's spelling is kept in the paths it prints.
"""

from __future__ import annotations

from pathlib import Path

RECORD_DIR = "record"
PLOTS_DIR = "plots"
ELASTIC_DIR = "elastic"
CONSUMERS_FILE = "consumers.json"
DYNAMO_DIR = "dynamo"
BENCH_DIR = "bench"
FLEETS_DIR = "fleets"
"""Under the job *root*: one record per standing fleet, ``<name>.json``."""


def record_dir(job_dir: str | Path) -> Path:
    """The router's request record (``router.record``; read by ``launcher.record``)."""
    return Path(job_dir) / RECORD_DIR


def plots_dir(job_dir: str | Path) -> Path:
    """The step timeline and per-engine load the driver writes at teardown (``launcher.record.plots``)."""
    return Path(job_dir) / PLOTS_DIR


def elastic_dir(job_dir: str | Path) -> Path:
    """Grow jobs' sbatch scripts and release files, and the resize requests and answers."""
    return Path(job_dir) / ELASTIC_DIR


def elastic_requests_dir(job_dir: str | Path) -> Path:
    return elastic_dir(job_dir) / "requests"


def elastic_answers_dir(job_dir: str | Path) -> Path:
    return elastic_dir(job_dir) / "answers"


def grow_file(job_dir: str | Path, grow_id: str, suffix: str) -> Path:
    """``elastic/grow-<id>.<suffix>``: a grow job's sbatch script (``sbatch``) or its release
    (``release``)."""
    return elastic_dir(job_dir) / f"grow-{grow_id}.{suffix}"


def consumers_file(job_dir: str | Path) -> Path:
    """A standing fleet's consumers and their keys (``router.consumers`` reads it, 0600)."""
    return Path(job_dir) / CONSUMERS_FILE


def dynamo_dir(job_dir: str | Path) -> Path:
    """The Dynamo front's etcd data and its planes' configs."""
    return Path(job_dir) / DYNAMO_DIR


def serve_fleet_file(job_dir: str | Path) -> Path:
    """The Ray Serve front's fleet state (``gateways.ray_serve.fleet_state``)."""
    return Path(job_dir) / "engines" / "serve-fleet.json"


def serve_registry_dir(job_dir: str | Path) -> Path:
    """Where each Ray Serve replica records its engine (``gateways.ray_serve.replica``)."""
    return Path(job_dir) / "engines" / "serve"


def bench_dir(job_dir: str | Path) -> Path:
    """A replay run as a job's training command writes its results here."""
    return Path(job_dir) / BENCH_DIR


def fleet_record_file(job_root: str | Path, name: str) -> Path:
    """A standing fleet's record under the job root (``launcher.fleet.standing``)."""
    return Path(job_root).expanduser() / FLEETS_DIR / f"{name}.json"
