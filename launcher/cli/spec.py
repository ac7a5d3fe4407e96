"""``rl-launch validate``, ``rl-launch render`` and ``rl-launch submit``: the job-spec commands.

Spec problems print ``SpecError``'s message (file, line, field, what to do) and exit with status 2,
the same status click uses for bad command lines, so scripts can tell "fix your input" (2) from "it
ran and failed" (1). ``submit --dry-run`` only reads and prints: it never imports submitit nor calls
``sbatch``; everything else in ``submit`` is ``launcher.submit.submit_job``.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click
import yaml

from launcher.spec import Issue, ResolvedSpec, SpecError
from launcher.spec.loading import load_checked
from launcher.spec.machine import Machine

if TYPE_CHECKING:
    from launcher.slurm.request import SlurmRequest

_SPEC_ARG = click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
_SET_OPT = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY.PATH=VALUE",
    help="Override one spec field (repeatable), e.g. --set generation.nodes=4; VALUE is read as YAML.",
)


def _issue_json(issue: Issue) -> dict[str, object]:
    return {"path": issue.path, "line": issue.line, "message": issue.message}


def _load(
    spec: Path,
    overrides: tuple[str, ...] = (),
    as_json: bool = False,
    attach_to: str | None = None,
    machine: bool = True,
) -> ResolvedSpec:
    """The resolved spec, or every problem printed and exit status 2. With ``machine`` (every command
    but the driver's inside an allocation, and ``validate --spec-only``) the spec is checked against this
    machine too (``launcher.spec.machine``): its errors are problems, its warnings are printed."""
    return _load_warned(spec, overrides, as_json, attach_to, machine)[0]


def _load_warned(
    spec: Path,
    overrides: tuple[str, ...] = (),
    as_json: bool = False,
    attach_to: str | None = None,
    machine: bool = True,
    strict: bool = False,
    say: bool = True,
) -> tuple[ResolvedSpec, tuple[Issue, ...]]:
    """``_load`` and the warnings, printed on stderr unless ``say`` is false (or ``as_json``: they are
    in the JSON); ``strict``: warnings fail too. In JSON, ``issues`` are the errors and ``warnings``
    the rest; in text, one sorted list holds both, so one read shows everything."""
    try:
        resolved, warnings = load_checked(spec, overrides, attach_to, Machine.here() if machine else None)
        if strict and warnings:
            raise SpecError(str(spec), [dataclasses.replace(w, warning=False) for w in warnings])
    except SpecError as exc:
        if as_json:
            payload = {
                "ok": False,
                "spec": str(spec),
                "issues": [_issue_json(i) for i in exc.issues if not i.warning],
                "warnings": [_issue_json(i) for i in exc.issues if i.warning],
            }
            click.echo(json.dumps(payload, indent=2))
        else:
            click.echo(str(exc), err=True)
        raise click.exceptions.Exit(2) from None
    if say and not as_json:
        say_warnings(spec, warnings)
    return resolved, warnings


def say_warnings(spec: Path, warnings: tuple[Issue, ...]) -> None:
    for warning in warnings:
        click.echo(warning.text(str(spec)), err=True)


def summarize(resolved: ResolvedSpec) -> list[str]:
    """A few lines a person can check at a glance: where, how many nodes, how many engines of what, and
    which front; the kinds say it themselves (``launcher.gateways.kinds``, ``launcher.engines.kinds``)."""
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
    from launcher.gateways.kinds import front_kind

    labels = resolved.kind_labels()
    command = train.command if len(train.command) <= 70 else train.command[:67] + "..."
    training = f"  training: {train.nodes} node(s): {command}"
    generation = (
        f"  generation: {gen.nodes} node(s) x {gen.engines_per_node} engine(s) = {labels['engines']}, "
        f"served as {gen.served_model_name!r}"
    )
    if gen.trainer_owned:
        generation = (
            f"  generation: {gen.nodes} node(s), {labels['engines']} at $RL_ROUTER_REGISTRATION_URL "
            "(rl-launch starts none)"
        )
    router = f"  router: {front_kind(resolved.router.kind).summary(resolved.router)}"
    if resolved.role == "attached":
        model = f", model {gen.served_model_name!r}" if gen.served_model_name else ""
        return [
            f"  name: {resolved.name}",
            f"  {where}",
            training,
            f"  generation: standing fleet {gen.fleet!r}{model}",
        ]
    if resolved.fleet is not None:
        f = resolved.fleet
        weights = ", ".join(
            f"{n} {c.weight:g}{' (admin)' if c.admin else ''}" for n, c in f.consumers.items()
        )
        training = (
            f"  standing fleet: no training; in-flight capacity {f.capacity} shared by weight "
            f"({weights or 'none named'}; others {f.default_weight:g})"
        )
    return [f"  name: {resolved.name}", f"  {where}", training, generation, router]


@click.command("validate")
@_SPEC_ARG
@_SET_OPT
@click.option("--json", "as_json", is_flag=True, help="Print the result (resolved spec or problems) as JSON.")
@click.option(
    "--spec-only",
    is_flag=True,
    help="Check the spec alone, not against this machine (its files, environment and install): for a spec "
    "that runs elsewhere.",
)
@click.option("--strict", is_flag=True, help="Fail (exit status 2) on warnings too.")
def validate_command(
    spec: Path, overrides: tuple[str, ...], as_json: bool, spec_only: bool, strict: bool
) -> None:
    """Check a job spec; print OK and a summary, or every problem (exit status 2).

    Problems that can be right where the job runs (a model directory only the compute nodes see, a
    container mount the site adds) are warnings: printed, exit status 0 (2 with --strict)."""
    resolved, warnings = _load_warned(spec, overrides, as_json, machine=not spec_only, strict=strict)
    if as_json:
        payload = {
            "ok": True,
            "spec": str(spec),
            "warnings": [_issue_json(w) for w in warnings],
            "resolved": resolved.model_dump(mode="json"),
        }
        click.echo(json.dumps(payload, indent=2))
        return
    click.echo(
        f"OK {spec}" + (f" ({len(warnings)} warning{'s' if len(warnings) > 1 else ''})" if warnings else "")
    )
    for line in summarize(resolved):
        click.echo(line)


@click.command("render")
@_SPEC_ARG
@_SET_OPT
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Where to write the script ('-' for stdout; default <job_root>/<name>.sbatch).",
)
def render_command(spec: Path, overrides: tuple[str, ...], output: Path | None) -> None:
    """Write the standalone sbatch script of a job spec (submit it with `sbatch FILE`)."""
    from launcher.submit.render import render_sbatch, write_sbatch

    resolved = _load(spec, overrides)
    if resolved.slurm is None:
        raise click.ClickException(
            f"{spec}: cluster is 'local', so there is no sbatch script; run `rl-launch submit {spec}`"
        )
    if output is not None and str(output) == "-":
        click.echo(render_sbatch(resolved, overrides=overrides), nl=False)
        return
    path = write_sbatch(resolved, output, overrides=overrides)
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
        click.echo("")
        for line in launch_lines(resolved, request):
            click.echo(line)
    click.echo("")
    click.echo("# dry run: nothing was submitted")


def _print_machine_problems(spec: Path, overrides: tuple[str, ...], fleet: str | None) -> None:
    """``submit --dry-run``: what this machine's checks (``launcher.spec.machine``) would stop or warn
    about, on stderr after the plan; the dry run itself only prints, so its exit status stays 0."""
    try:
        warnings = load_checked(spec, overrides, fleet, Machine.here())[1]
    except SpecError as exc:
        for issue in exc.issues:
            click.echo(
                issue.text(str(spec)) if issue.warning else f"submit would stop: {issue.text(str(spec))}",
                err=True,
            )
        return
    for warning in warnings:
        click.echo(warning.text(str(spec)), err=True)


def launch_lines(resolved: ResolvedSpec, request: SlurmRequest) -> list[str]:
    """The command lines that will run: the batch script's last line, and the ``srun`` line of each step
    the driver starts (node names and ports come from the allocation, so they are placeholders)."""
    from launcher.slurm.srun import step_command

    if request.submitit_parameters is not None:
        folder = Path(resolved.job_root) / "submitit" / "%j"
        inner = f"{shlex.quote(sys.executable)} -u -m submitit.core._submit {shlex.quote(str(folder))}"
        where = "the submitit batch script's setup line (its own command line after it is never reached)"
    else:
        from launcher.submit.render import driver_command, rl_launch_command

        inner = driver_command(rl_launch_command(), resolved.spec_path or "SPEC")
        where = "the last line of the batch script (rl-launch render)"
    gen = resolved.generation
    gpus = gen.resources.gpus_per_node if gen.resources is not None else 0
    hetjob = resolved.slurm is not None and resolved.slurm.layout == "hetjob"
    worker = step_command(
        node="<node>",
        name="ray-worker-<node>",
        log="<job_dir>/logs/ray-worker-<node>.log",
        argv=["<ray start --address=<head> --block>"],
        container=request.srun_args,
        het_group=(0 if hetjob else None),
    )
    host = step_command(
        node="<node>",
        name="engines-<node>",
        log="<job_dir>/logs/engine-host-node<i>.log",
        argv=["<python -m launcher.engines.host --config <job_dir>/engines/node-<i>.json>"],
        container=request.srun_args,
        gpus=gpus,
        het_group=(1 if hetjob else None),
    )
    container = "in the container" if request.srun_args else "no container"
    return [
        f"# the driver ({container}): {where}",
        request.driver_line(inner),
        f"# time-limit warning: --signal={request.signal} (the driver only; it tears the job down)",
        "# a Ray worker on every node but the driver's (hetjob: --het-group of its component)",
        " ".join(worker),
        *(
            ["# no engine host: the trainer starts its engines (generation.owner: trainer)"]
            if gen.trainer_owned
            else [f"# an engine host on each of the {gen.nodes} generation node(s)", " ".join(host)]
        ),
        "# the Ray head, the router and the training command run inside the driver's step",
    ]


@click.command("submit")
@_SPEC_ARG
@_SET_OPT
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the resolved spec, the Slurm request and what this machine's checks would stop; submit "
    "nothing.",
)
@click.option("--follow", is_flag=True, help="Stay attached after submitting and stream the job's progress.")
@click.option(
    "--in-allocation",
    is_flag=True,
    hidden=True,  # the batch script's, not a user's: --help listed it as a choice
    help="Run the driver inside an existing allocation (what the batch script calls; not for users).",
)
@click.option(
    "--job-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    hidden=True,
    help="The job's directory (logs, state, Gym overlay); with --in-allocation.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the job id and job directory as JSON.")
@click.option(
    "--fleet",
    "fleet",
    default=None,
    metavar="NAME",
    help="Attach to this standing fleet (rl-launch fleet up) instead of the spec's own generation.",
)
def submit_command(
    spec: Path,
    overrides: tuple[str, ...],
    dry_run: bool,
    follow: bool,
    in_allocation: bool,
    job_dir: Path | None,
    as_json: bool,
    fleet: str | None,
) -> None:
    """Submit a job spec to Slurm (or run it locally with cluster: local)."""
    if dry_run and in_allocation:
        raise click.UsageError("--dry-run and --in-allocation exclude each other")
    if dry_run:
        _print_dry_run(spec, _load(spec, overrides, attach_to=fleet, machine=False))
        _print_machine_problems(spec, overrides, fleet)
        return
    # inside an allocation the driver is on another node, maybe in another directory: the login side checked
    resolved, warnings = _load_warned(spec, overrides, attach_to=fleet, machine=not in_allocation, say=False)
    if resolved.role == "fleet":
        raise click.ClickException(
            f"{spec}: a standing fleet spec (fleet:) is started with `rl-launch fleet up {spec}`"
        )
    if resolved.cluster == "slurm":
        from launcher.slurm.commands import SlurmCommandMissing, require

        try:
            if in_allocation:
                require(["srun"], "running the driver in an allocation")
            else:
                require(["sbatch", "srun"], f"submitting {spec} (cluster: slurm)")
        except SlurmCommandMissing as exc:
            raise click.ClickException(str(exc)) from None
    say_warnings(spec, warnings)  # after the one line that says this machine cannot submit at all
    from launcher.submit.job import SubmitError, submit_job

    if not in_allocation:  # a job root others may rename things in: refused before anything starts
        from launcher.jobdir.ownership import Untrusted, ensure_job_root

        try:
            ensure_job_root(resolved.job_root)
        except Untrusted as exc:
            raise click.ClickException(str(exc)) from None
    if resolved.role == "attached" and not in_allocation:
        from launcher.fleet.standing import FleetRefused
        from launcher.submit.fleet import check_attachable

        try:  # before anything is allocated: a job that could not attach must not wait in the queue
            check_attachable(resolved, lambda m: click.echo(m, err=True))
        except FleetRefused as exc:
            raise click.ClickException(str(exc)) from None
    try:
        code = submit_job(
            resolved, follow=follow, in_allocation=in_allocation, job_dir=job_dir, as_json=as_json
        )
    except SubmitError as exc:
        raise click.ClickException(str(exc)) from None
    raise SystemExit(code)
