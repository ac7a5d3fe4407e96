"""``rl-launch fleet ...``: operations on a running job's whole fleet.

``reset-cache JOB`` flushes every engine's prefix cache after a weight update (see
``router.fleet.cache_reset``): through our router's admin route (``router.kind: builtin``, which also clears
the router's prefix index), straight to each Dynamo worker's ``/engine/flush_cache`` (``router.kind:
dynamo``; Dynamo's KV router drops the blocks as the workers' removal events arrive), or straight to each
engine's ``/reset_prefix_cache`` behind a front that has no such route (``vllm-router``, ``ray-serve``:
the engines are the job's own, listed in its job directory; those fronts' own routing state is theirs
to age out). The report is recorded in the job directory, where ``rl-launch status`` shows when it last
ran.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import click

from launcher.cli_jobs import _ROOT, resolve_job
from launcher.http_call import bearer, open_url
from launcher.jobdir import JobDir
from router.fleet.cache_reset import DYNAMO_RESET_PATH, VLLM_RESET_PATH, CacheResetReport, reset_engines


@click.group("fleet")
def fleet_group() -> None:
    """Fleet-wide operations on a running job: pause/resume, abort, weight versions, checksums, step
    metrics, cache invalidation."""


def _via_router(jd: JobDir, router_url: str, timeout_s: float) -> CacheResetReport:
    """The builtin router's own route; ``router_url`` is the job's ``fleet_url`` (the driver records it
    for the builtin router: the admin token goes nowhere else)."""
    req = urllib.request.Request(
        router_url + "/fleet/reset_prefix_cache",
        data=b"",
        method="POST",
        headers=bearer(jd.read_admin_token()),
    )
    try:
        with open_url(req, timeout=timeout_s) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
        if exc.code != 500:
            raise click.ClickException(
                f"router {router_url} answered {exc.code} ({exc.reason}): {body[:300]!r}"
            ) from None
    except OSError as exc:
        raise click.ClickException(f"router {router_url} unreachable: {exc}") from None
    return CacheResetReport.from_json(json.loads(body))


def _via_engines(jd: JobDir, path: str, api_key: str | None, timeout_s: float) -> CacheResetReport:
    """Every engine the job directory lists, at once (no front in between)."""
    urls = [e.url for e in jd.engine_entries() if e.url]
    return CacheResetReport(asyncio.run(reset_engines(urls, path, api_key, timeout_s)))


@fleet_group.command("reset-cache")
@click.argument("job", required=False)
@click.option("--timeout", "timeout_s", default=60.0, show_default=True, help="Seconds per engine.")
@click.option("--json", "as_json", is_flag=True, help="Print the per-engine report as JSON.")
@_ROOT
def reset_cache_command(job: str | None, timeout_s: float, as_json: bool, root: Path) -> None:
    """Flush every engine's prefix cache and the router's prefix index (run it after each weight update);
    exit 1 when any engine did not comply."""
    jd = JobDir(resolve_job(job, root))
    state = jd.read_state()
    router_url = state.get("router_url")
    if not router_url or state.get("torn_down"):
        raise click.ClickException(f"job {jd.path.name} has no serving fleet (state: {state.get('phase')})")
    kind = jd.read_spec().router.kind
    t = time.monotonic()
    if kind == "dynamo":
        report = _via_engines(jd, DYNAMO_RESET_PATH, None, timeout_s)
    elif kind == "builtin" and state.get("fleet_url"):
        report = _via_router(jd, str(state["fleet_url"]), timeout_s)
    else:  # a front without a fleet route: the job's engines take the job's API key
        report = _via_engines(jd, VLLM_RESET_PATH, jd.read_api_key(), timeout_s)
    jd.write_cache_reset(report.to_json())
    jd.log_event(
        "cache_reset",
        f"prefix caches flushed on {len(report.engines) - len(report.failures())}/{len(report.engines)}",
        ok=report.ok,
        took_s=round(time.monotonic() - t, 3),
    )
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        for e in report.engines:
            click.echo(f"{'ok  ' if e.ok else 'FAIL'} {e.url}  {e.detail if not e.ok else ''}".rstrip())
        if report.router_entries_dropped is not None:
            click.echo(f"router prefix index cleared ({report.router_entries_dropped} entries)")
    if not report.ok:
        failed = report.failures()
        why = failed[0].detail if failed else "no engine is serving"
        raise click.ClickException(f"{len(failed)} of {len(report.engines)} engine(s) did not flush: {why}")


# The refit window (pause, resume, abort, versions, checksums, steps): its own module, same group.
from launcher.cli_fleet_refit import register as _register_refit  # noqa: E402

_register_refit(fleet_group)
