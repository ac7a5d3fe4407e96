"""``rl-launch check SPEC``: will this spec run here? The login node's checks, then one probe step per
group on a node like the job's (``launcher.check``). One line per check; a failure names its fix.

Exit status: 0 when nothing failed, 1 when a check failed, 2 for a spec that does not validate (as
``validate``), so a script can tell "the site is not ready" from "fix your input".
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from launcher.check.run import DEFAULT_TIMEOUT_S
from launcher.cli.spec import _SET_OPT, _SPEC_ARG, _load


@click.command("check")
@_SPEC_ARG
@_SET_OPT
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=10),
    default=DEFAULT_TIMEOUT_S,
    show_default=True,
    help="Seconds the probe steps may take, queue wait included; a probe still pending then is cancelled.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
def check_command(spec: Path, overrides: tuple[str, ...], timeout_s: float, as_json: bool) -> None:
    """Check that a spec can run on this site, before the first allocation: one line per failure, with
    its fix."""
    from launcher.check.run import check_spec

    resolved = _load(spec, overrides, as_json)
    say = (lambda _m: None) if as_json else (lambda m: click.echo(m, err=True))
    checks = check_spec(resolved, timeout_s=timeout_s, say=say)
    failed = [c for c in checks if c.failed]
    if as_json:
        payload = {"ok": not failed, "spec": str(spec), "checks": [c.as_dict() for c in checks]}
        click.echo(json.dumps(payload, indent=2))
    else:
        where = "cluster: local (this machine)" if resolved.slurm is None else "cluster: slurm"
        click.echo(f"check {spec} ({where})")
        for c in checks:
            click.echo(f"  {c.line()}")
        verdict = (
            f"{len(failed)} of {len(checks)} checks failed" if failed else f"all {len(checks)} checks passed"
        )
        click.echo(f"{'FAILED' if failed else 'OK'}: {verdict}")
    raise click.exceptions.Exit(1 if failed else 0)
