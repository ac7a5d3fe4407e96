"""Submitting a job and running its driver inside the allocation (``rl-launch submit``).

TODO(lead): the only stub left by the spec/render work; ``launcher.cli_spec`` calls ``submit_job`` for
every non-dry-run ``rl-launch submit``.
"""

from __future__ import annotations

from pathlib import Path

from launcher.spec import ResolvedSpec


def submit_job(
    spec: ResolvedSpec,
    *,
    follow: bool = False,
    in_allocation: bool = False,
    job_dir: Path | None = None,
) -> None:
    """Submit ``spec`` (submitit for a single allocation, the rendered sbatch script for a hetjob), or,
    with ``in_allocation``, run the driver inside the allocation using ``job_dir``.

    ``spec`` is already resolved and valid: ``spec.slurm.layout``, ``launcher.slurm.build_request(spec)``
    and ``launcher.slurm.split_nodes(spec)`` give the request and the node split.
    """
    raise NotImplementedError(
        "TODO(lead): rl-launch submit without --dry-run is not implemented yet "
        f"(spec {spec.name!r}, follow={follow}, in_allocation={in_allocation}, job_dir={job_dir})"
    )
