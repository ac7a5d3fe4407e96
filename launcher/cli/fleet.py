"""``rl-launch fleet ...``: operations on a running job's whole fleet.

``reset-cache JOB`` flushes every engine's prefix cache after a weight update (see
``router.fleet.cache_reset``): through our router's admin route (``router.kind: builtin``, which also clears
the router's prefix index), straight to each Dynamo worker's ``/engine/flush_cache`` (``router.kind:
dynamo``; Dynamo's KV router drops the blocks as the workers' removal events arrive), or straight to each
engine's ``/reset_prefix_cache`` behind a front that has no such route (``vllm-router``, ``ray-serve``:
the engines are the job's own, listed in its job directory; those fronts' own routing state is theirs
to age out). The report is recorded in the job directory, where ``rl-launch status`` shows when it last
ran.

``pause|resume|is-paused|abort|version|checksum|step JOB`` open the refit window by hand: the same
operations a trainer drives through ``launcher.fleet.client`` (each through the ``/fleet/*`` routes, which
fan out to every engine: the builtin router's own, or the driver's fleet endpoint beside vllm-router or
Ray Serve), for an operator or a shell-scripted trainer. Each prints one line per engine and exits 1 when
any engine did not comply. A front with no such routes (Dynamo: its engines do not serve vLLM's dev
routes) is refused with what it does offer.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from launcher.cli.options import lookup_job, root_option
from launcher.fleet.client import FleetClient
from launcher.jobdir import JobDir
from launcher.net.http_call import bearer, open_url
from router.fleet.cache_reset import CacheResetReport, reset_engines
from router.fleet.engine import PAUSE_MODES
from router.fleet.ops import FleetOpReport

_JSON = click.option("--json", "as_json", is_flag=True, help="Print the per-engine report as JSON.")


@click.group("fleet")
def fleet_group() -> None:
    """Fleet-wide operations on a running job: pause/resume, abort, weight versions, checksums, step
    metrics, cache invalidation; resizing (grow, shrink); standing fleets (up, down)."""


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
@_JSON
@root_option
def reset_cache_command(job: str | None, timeout_s: float, as_json: bool, root: Path) -> None:
    """Flush every engine's prefix cache and the router's prefix index (run it after each weight update);
    exit 1 when any engine did not comply."""
    jd = JobDir(lookup_job(job, root))
    state = jd.read_state()
    router_url = state.get("router_url")
    if not router_url or state.get("torn_down"):
        raise click.ClickException(f"job {jd.path.name} has no serving fleet (state: {state.get('phase')})")
    from launcher.engines.kinds import engine_kind
    from launcher.gateways.kinds import front_kind
    from launcher.spec.snapshot import read_spec

    spec = read_spec(jd)
    route = front_kind(spec.router.kind).cache_reset(engine_kind(spec.generation.engine))
    t = time.monotonic()
    if route.via_fleet_route and state.get("fleet_url"):
        report = _via_router(jd, str(state["fleet_url"]), timeout_s)
    else:  # straight at the job's engines (with the job's engine key where they take one)
        key = jd.read_engine_key() if route.with_api_key else None
        report = _via_engines(jd, route.engine_path, key, timeout_s)
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


# The refit window by hand: the operations a trainer drives through launcher.fleet.client.

_TIMEOUT = click.option("--timeout", "timeout_s", default=300.0, show_default=True, help="Seconds in all.")


def _client(job: str | None, root: Path, timeout_s: float, op: str) -> tuple[JobDir, FleetClient]:
    jd = JobDir(lookup_job(job, root))
    state = jd.read_state()
    if not state.get("router_url") or state.get("torn_down"):
        raise click.ClickException(f"job {jd.path.name} has no serving fleet (state: {state.get('phase')})")
    if not state.get("fleet_url"):
        from launcher.gateways.kinds import GATEWAY_KINDS, front_kind

        attached = state.get("attached_to") or {}
        if attached:
            raise click.ClickException(
                f"fleet {op}: job {jd.path.name} is attached to standing fleet {attached.get('fleet')!r} "
                "as a plain consumer; only the fleet's owner (rl-launch fleet ... on the fleet's job) or a "
                "job the fleet's spec names with admin: true under fleet.consumers may"
            )
        from launcher.spec.snapshot import read_spec

        kind = read_spec(jd).router.kind
        with_routes = ", ".join(n for n, front in GATEWAY_KINDS.items() if front.has_fleet_routes)
        why = front_kind(kind).no_fleet_routes_why
        raise click.ClickException(
            f"fleet {op}: job {jd.path.name} runs router.kind {kind!r}, which has no fleet-wide {op} "
            f"({with_routes} fan the refit window out to every engine)"
            + (f": {why}" if why else "")
            + "; `rl-launch fleet reset-cache` works for it"
        )
    try:
        return jd, FleetClient.from_job_dir(jd.path, timeout_s)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


def _run(jd: JobDir, op: str, call: Callable[[], FleetOpReport], as_json: bool) -> FleetOpReport:
    t = time.monotonic()
    try:
        report = call()
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None
    jd.log_event(f"fleet_{op}", report.why() or "ok", ok=report.ok, took_s=round(time.monotonic() - t, 3))
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        for e in report.engines:
            click.echo(f"{'ok  ' if e.ok else 'FAIL'} {e.url}  {e.detail if not e.ok else ''}".rstrip())
    return report


def _done(report: FleetOpReport, as_json: bool, summary: str) -> None:
    if not as_json:
        click.echo(summary)
    if not report.ok:
        raise click.ClickException(f"fleet {report.op}: {report.why()}")


@fleet_group.command("pause")
@click.argument("job", required=False)
@click.option(
    "--mode",
    type=click.Choice(PAUSE_MODES),
    default="keep",
    show_default=True,
    help="keep: freeze in-flight requests until resume; wait: let them finish; abort: abort them.",
)
@_TIMEOUT
@_JSON
@root_option
def pause_command(job: str | None, mode: str, timeout_s: float, as_json: bool, root: Path) -> None:
    """Pause every engine; the router holds new requests until `fleet resume`."""
    jd, client = _client(job, root, timeout_s, "pause")
    report = _run(jd, "pause", lambda: client.pause(mode, check=False), as_json)
    _done(report, as_json, f"fleet paused ({mode}) in {report.took_s:.3f} s; new requests are held")


@fleet_group.command("resume")
@click.argument("job", required=False)
@_TIMEOUT
@_JSON
@root_option
def resume_command(job: str | None, timeout_s: float, as_json: bool, root: Path) -> None:
    """Resume every engine and release the held requests in arrival order."""
    jd, client = _client(job, root, timeout_s, "resume")
    report = _run(jd, "resume", lambda: client.resume(check=False), as_json)
    r = report.result
    _done(
        report,
        as_json,
        f"fleet resumed after {r.get('paused_for_s', 0):.3f} s paused; {r.get('released', 0)} held "
        f"request(s) released, longest wait {r.get('held_longest_wait_s', 0):.3f} s",
    )


@fleet_group.command("is-paused")
@click.argument("job", required=False)
@_TIMEOUT
@_JSON
@root_option
def is_paused_command(job: str | None, timeout_s: float, as_json: bool, root: Path) -> None:
    """Whether the router holds requests and each engine reports paused."""
    jd, client = _client(job, root, timeout_s, "is-paused")
    report = _run(jd, "is_paused", lambda: client._op("GET", "/fleet/is_paused", check=False), as_json)
    r = report.result
    engines = r.get("engines_paused", {})
    _done(
        report,
        as_json,
        f"router {'holding' if r.get('router_paused') else 'not paused'} ({r.get('held', 0)} held); "
        f"engines paused: {sum(engines.values())}/{len(engines)}",
    )


@fleet_group.command("abort")
@click.argument("job", required=False)
@click.option("--id", "ids", multiple=True, help="A request id to abort (repeat); none: abort all.")
@_TIMEOUT
@_JSON
@root_option
def abort_command(job: str | None, ids: tuple[str, ...], timeout_s: float, as_json: bool, root: Path) -> None:
    """Abort in-flight requests on every engine (all, or the given ids)."""
    jd, client = _client(job, root, timeout_s, "abort")
    report = _run(jd, "abort", lambda: client.abort(list(ids), check=False), as_json)
    n = report.result.get("aborted")
    _done(report, as_json, f"{n} request(s) aborted" if n is not None else f"abort sent for {list(ids)}")


@fleet_group.command("version")
@click.argument("job", required=False)
@click.option("--set", "new_version", default=None, help="Stamp this weight version.")
@click.option("--engine", "engines", multiple=True, help="With --set: stamp only this engine (refit).")
@_TIMEOUT
@_JSON
@root_option
def version_command(
    job: str | None,
    new_version: str | None,
    engines: tuple[str, ...],
    timeout_s: float,
    as_json: bool,
    root: Path,
) -> None:
    """Show each engine's weight version and the stale ones; --set stamps a version (the whole fleet,
    or --engine URLs after refitting them, which readmits them)."""
    jd, client = _client(job, root, timeout_s, "version")
    if engines and new_version is None:
        raise click.ClickException("--engine needs --set VERSION (the fleet's current version)")
    if new_version is not None:
        targets = list(engines) if engines else None
        report = _run(jd, "version", lambda: client.set_weight_version(new_version, targets, False), as_json)
    else:
        report = _run(jd, "version", lambda: client.weight_version(check=False), as_json)
    r: dict[str, Any] = report.result
    lines = [f"fleet version: {r.get('current')!r}"]
    lines += [f"  {u}: {v!r}" for u, v in (r.get("engines") or {}).items()]
    lines += [f"  STALE {u}: {why}" for u, why in (r.get("stale") or {}).items()]
    _done(report, as_json, "\n".join(lines))


@fleet_group.command("checksum")
@click.argument("job", required=False)
@_TIMEOUT
@_JSON
@root_option
def checksum_command(job: str | None, timeout_s: float, as_json: bool, root: Path) -> None:
    """Check that every serving engine holds the same weights (vLLM's weight checksums)."""
    jd, client = _client(job, root, timeout_s, "checksum")
    report = _run(jd, "checksum", lambda: client.checksum(check=False), as_json)
    groups = report.result.get("groups") or {}
    lines = [f"{len(groups)} checksum group(s) over {report.result.get('parameters', 0)} parameters"]
    lines += [f"  {d}: {urls}" for d, urls in groups.items()]
    _done(report, as_json, "\n".join(lines))


@fleet_group.command("step")
@click.argument("job", required=False)
@click.option("--begin", is_flag=True, help="Start a new step (snapshot the engines' counters).")
@_TIMEOUT
@root_option
def step_command(job: str | None, begin: bool, timeout_s: float, root: Path) -> None:
    """The engines' counters since the current step began (JSON), or --begin a new step."""
    _, client = _client(job, root, timeout_s, "step")
    try:
        if begin:
            click.echo(f"step {client.begin_step()} begun")
        else:
            click.echo(json.dumps(client.step_metrics(), indent=2))
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None


@fleet_group.command("refit")
@click.argument("job", required=False)
@click.option("--from", "directory", required=True, help="Checkpoint directory every node sees (absolute).")
@click.option("--version", "version", default=None, help="The version the fleet (or --adapter) moves to.")
@click.option(
    "--adapter",
    default=None,
    help="Refit this LoRA adapter from --from (a peft adapter directory) instead of the base weights: "
    "nothing pauses; its version defaults to v<n>.",
)
@click.option("--expected-checksum", default=None, help="The checksum every engine must end on.")
@click.option(
    "--deadline", "deadline_s", default=900.0, show_default=True, help="Seconds for the whole refit."
)
@_JSON
@root_option
def refit_command(
    job: str | None,
    directory: str,
    version: str | None,
    adapter: str | None,
    expected_checksum: str | None,
    deadline_s: float,
    as_json: bool,
    root: Path,
) -> None:
    """Load a checkpoint directory into every engine as one transaction: pause, reload, verify the
    checksums, reset the prefix caches, stamp VERSION, resume. Engines that fail are quarantined (held out,
    named with the reason); a bad directory is refused before anything pauses. With --adapter, refit one
    LoRA adapter instead: check, canary, every engine, verify, stamp, with no pause."""
    jd, client = _client(job, root, deadline_s + 60, "refit")
    if adapter is not None:
        _refit_adapter(jd, client, adapter, directory, version, deadline_s, as_json)
        return
    if version is None:
        raise click.UsageError("--version is required (the weight version the fleet moves to)")
    t = time.monotonic()
    try:
        txn = client.load_weights(directory, version, expected_checksum, deadline_s, check=False)
    except (ValueError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    bad = txn.get("quarantined") or {}
    jd.log_event(
        "fleet_refit",
        f"{version}: {txn['phase']}",
        ok=bool(txn.get("ok")),
        took_s=round(time.monotonic() - t, 3),
        quarantined=sorted(bad),
    )
    if as_json:
        click.echo(json.dumps(txn, indent=2))
    else:
        for s in txn.get("steps", []):
            click.echo(f"  {s['phase']:<10} {s['took_s']:8.3f} s  {s['engines']} engine(s)")
        for u in txn.get("verified", []):
            click.echo(f"ok   {u}  {version}")
        for u, why in bad.items():
            click.echo(f"OUT  {u}  {why}")
        click.echo(
            f"refit {txn['id']} {txn['phase']} in {txn['elapsed_s']:.3f} s: "
            f"{len(txn.get('verified', []))} engine(s) on {version!r}, {len(bad)} quarantined; "
            f"checksum {txn.get('checksum')}"
        )
    if not txn.get("moved"):
        raise click.ClickException(f"fleet refit: the fleet did not move to {version!r}: {txn.get('error')}")


def _refit_adapter(
    jd: JobDir,
    client: FleetClient,
    adapter: str,
    directory: str,
    version: str | None,
    deadline_s: float,
    as_json: bool,
) -> None:
    t = time.monotonic()
    try:
        txn = client.load_adapter(adapter, directory, version, deadline_s, check=False)
    except (ValueError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    missing = txn.get("missing") or {}
    jd.log_event(
        "adapter_refit",
        f"{adapter}@{txn.get('version')}: {txn.get('phase')}",
        ok=bool(txn.get("ok")),
        took_s=round(time.monotonic() - t, 3),
        missing=sorted(missing),
    )
    if as_json:
        click.echo(json.dumps(txn, indent=2))
    else:
        for s in txn.get("steps", []):
            click.echo(f"  {s['phase']:<10} {s['took_s']:8.3f} s")
        for u in txn.get("verified", []):
            click.echo(f"ok   {u}  {txn.get('served_name')}")
        for u, why in missing.items():
            click.echo(f"--   {u}  {why}")
        click.echo(
            f"adapter refit {txn.get('id')} {txn.get('phase')} in {txn.get('elapsed_s', 0):.3f} s: "
            f"{adapter!r} on {txn.get('version')!r} on {len(txn.get('verified', []))} engine(s)"
            + (f"; canary {txn['canary']}" if txn.get("canary") else "")
        )
    if not txn.get("moved"):
        raise click.ClickException(f"fleet refit --adapter {adapter}: not moved: {txn.get('error')}")


def _add_standing_commands() -> None:
    from launcher.cli.elastic import fleet_grow_command, fleet_shrink_command
    from launcher.cli.standing import fleet_down_command, fleet_up_command

    fleet_group.add_command(fleet_up_command)
    fleet_group.add_command(fleet_down_command)
    fleet_group.add_command(fleet_grow_command)
    fleet_group.add_command(fleet_shrink_command)


_add_standing_commands()
