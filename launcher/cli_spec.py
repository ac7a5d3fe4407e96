"""``rl-launch validate``, ``rl-launch render`` and ``rl-launch submit``: the job-spec commands.

Spec problems print ``SpecError``'s message (file, line, field, what to do) and exit with status 2,
the same status click uses for bad command lines, so scripts can tell "fix your input" (2) from "it
ran and failed" (1). ``submit --dry-run`` only reads and prints: it never imports submitit nor calls
``sbatch``; everything else in ``submit`` is ``launcher.submit.submit_job``.
"""

from __future__ import annotations

from pathlib import Path

import click
import yaml

from launcher.spec import ResolvedSpec, SpecError, load_resolved

_SPEC_ARG = click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))


def _load(spec: Path) -> ResolvedSpec:
    try:
        return load_resolved(spec)
    except SpecError as exc:
        click.echo(str(exc), err=True)
        raise click.exceptions.Exit(2) from None


def summarize(resolved: ResolvedSpec) -> list[str]:
    """A few lines a person can check at a glance: where, how many nodes, how many engines of what."""
    gen, train = resolved.generation, resolved.training
    if resolved.slurm is None:
        where = "cluster: local (this machine)"
    else:
        layout = (
            f"one allocation of {resolved.total_nodes} nodes"
            if resolved.slurm.layout == "single"
            else f"heterogeneous job, {resolved.total_nodes} nodes"
        )
        where = f"cluster: slurm, {layout}, time {resolved.slurm.time}"
    if gen.engine == "vllm":
        what = f"vllm {gen.model}"
        if gen.gpus_per_engine:
            what += (
                f" (TP {gen.tensor_parallel_size} x PP {gen.pipeline_parallel_size} = "
                f"{gen.gpus_per_engine} GPUs each)"
            )
        else:
            what += " (on CPUs)"
    else:
        what = "sim"
    command = train.command if len(train.command) <= 70 else train.command[:67] + "..."
    lo, hi = resolved.router.port_range
    return [
        f"  name: {resolved.name}",
        f"  {where}",
        f"  training: {train.nodes} node(s): {command}",
        f"  generation: {gen.nodes} node(s) x {gen.engines_per_node} engine(s) = {gen.num_engines} {what}, "
        f"served as {gen.served_model_name!r}",
        f"  router: {resolved.router.policy}, port in {lo}-{hi}",
    ]


@click.command("validate")
@_SPEC_ARG
def validate_command(spec: Path) -> None:
    """Check a job spec; print OK and a summary, or every problem (exit status 2)."""
    resolved = _load(spec)
    click.echo(f"OK {spec}")
    for line in summarize(resolved):
        click.echo(line)


@click.command("render")
@_SPEC_ARG
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Where to write the script ('-' for stdout; default <job_root>/<name>.sbatch).",
)
def render_command(spec: Path, output: Path | None) -> None:
    """Write the standalone sbatch script of a job spec (submit it with `sbatch FILE`)."""
    from launcher.render import render_sbatch, write_sbatch

    resolved = _load(spec)
    if resolved.slurm is None:
        raise click.ClickException(
            f"{spec}: cluster is 'local', so there is no sbatch script; run `rl-launch submit {spec}`"
        )
    if output is not None and str(output) == "-":
        click.echo(render_sbatch(resolved), nl=False)
        return
    path = write_sbatch(resolved, output)
    click.echo(f"wrote {path}")
    click.echo(f"submit with: sbatch {path}")


def _print_dry_run(spec: Path, resolved: ResolvedSpec) -> None:
    from launcher.slurm.request import build_request

    click.echo(f"# resolved spec ({spec})")
    click.echo(resolved.to_yaml().rstrip())
    click.echo("")
    if resolved.slurm is None:
        click.echo("# cluster: local: no Slurm request; the driver would run everything on this machine")
    else:
        request = build_request(resolved)
        if request.layout == "single":
            click.echo(
                f"# Slurm request: one allocation of {request.total_nodes} nodes; the first "
                f"{resolved.training.nodes} (sorted) are training, the rest generation"
            )
        else:
            click.echo("# Slurm request: heterogeneous job (component 0 training, component 1 generation)")
        for line in request.directive_lines:
            click.echo(line)
        click.echo("")
        if request.submitit_parameters is None:
            click.echo("# submitit parameters: none (submitit cannot submit a heterogeneous job;")
            click.echo("# the rendered sbatch script is used instead: rl-launch render)")
        else:
            click.echo("# submitit parameters (AutoExecutor.update_parameters)")
            click.echo(yaml.safe_dump(request.submitit_parameters, sort_keys=False).rstrip())
        if request.srun_args:
            click.echo("")
            click.echo("# srun arguments of the driver's steps (container)")
            click.echo(" ".join(request.srun_args))
    click.echo("")
    click.echo("# dry run: nothing was submitted")


@click.command("submit")
@_SPEC_ARG
@click.option(
    "--dry-run", is_flag=True, help="Print the resolved spec and the Slurm request; submit nothing."
)
@click.option("--follow", is_flag=True, help="Stay attached after submitting and stream the job's progress.")
@click.option(
    "--in-allocation",
    is_flag=True,
    help="Run the driver inside an existing allocation (what the batch script calls; not for users).",
)
@click.option(
    "--job-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The job's directory (logs, state, Gym overlay); with --in-allocation.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the job id and job directory as JSON.")
def submit_command(
    spec: Path, dry_run: bool, follow: bool, in_allocation: bool, job_dir: Path | None, as_json: bool
) -> None:
    """Submit a job spec to Slurm (or run it locally with cluster: local)."""
    if dry_run and in_allocation:
        raise click.UsageError("--dry-run and --in-allocation exclude each other")
    resolved = _load(spec)
    if dry_run:
        _print_dry_run(spec, resolved)
        return
    from launcher.submit import SubmitError, submit_job

    try:
        code = submit_job(
            resolved, follow=follow, in_allocation=in_allocation, job_dir=job_dir, as_json=as_json
        )
    except SubmitError as exc:
        raise click.ClickException(str(exc)) from None
    raise SystemExit(code)
