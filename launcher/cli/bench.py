"""``rl-launch bench``: make replay traces and replay them against the fleet, a router, or simulated arms.

Kept apart from the library modules so the workload, client and report can be used from tests and
notebooks without click; this module only parses options, wires the pieces and prints.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from launcher.bench.arms import (
    DIRECT,
    ArmOutcome,
    front_of,
    run_compare,
    run_direct,
    run_url,
    validate_arms,
)
from launcher.bench.client import ClientConfig, RetryPolicy, SessionRecord
from launcher.bench.report import default_paths, render_table, write_csv, write_json, write_png
from launcher.bench.workload import (
    MAX_TOKENS,
    WORKLOADS,
    Trace,
    generate,
    load_trace,
    save_trace,
    trace_stats,
)

DEFAULT_RESULTS_DIR = "bench/results"
JOB_DIR_ENV = "RL_JOB_DIR"
"""Set by the driver for the training command: a replay run as a job's "training" writes there."""


def default_results_dir() -> Path:
    """``$RL_JOB_DIR/bench`` inside a job, else ``bench/results``: a job's outputs belong in its job
    directory, never in whatever directory it was submitted from (which Slurm makes the job's cwd)."""
    job_dir = os.environ.get(JOB_DIR_ENV)
    return Path(job_dir) / "bench" if job_dir else Path(DEFAULT_RESULTS_DIR)


def job_engine_urls() -> list[str]:
    """Inside a job (``$RL_JOB_DIR``): the engines its listings name, for the per-engine figures of a
    ``--url`` replay. The router's ``GET /workers`` needs the admin token, which a trainer never holds;
    the job directory is where the launcher publishes the fleet."""
    job_dir = os.environ.get(JOB_DIR_ENV)
    if not job_dir:
        return []
    from launcher.jobdir import JobDir

    try:
        listings = JobDir(Path(job_dir)).listings()
    except (OSError, ValueError):
        return []
    return [e.api_url or e.url for listing in listings for e in listing.engines if e.api_url or e.url]


def _workload_options(f: Any) -> Any:
    """The options that define a generated trace, shared by ``trace`` and ``replay``."""
    opts = [
        click.option("--workload", type=click.Choice(WORKLOADS), default="p30_all", show_default=True),
        click.option("--seed", type=int, default=1, show_default=True, help="Same seed, same trace."),
        click.option(
            "--scale",
            type=click.FloatRange(min=0.0, min_open=True),
            default=1.0,
            show_default=True,
            help="Multiply the session count and every size (prompt, tool output, max_tokens).",
        ),
        click.option(
            "--group-size",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="GRPO group size: G sessions per task, with an identical first turn.",
        ),
        click.option(
            "--turn-scale",
            type=click.FloatRange(min=0.0, min_open=True),
            default=1.0,
            show_default=True,
            help="Also shorten sessions (smoke runs; changes the workload's shape).",
        ),
        click.option(
            "--max-tokens",
            type=click.IntRange(min=1),
            default=MAX_TOKENS,
            show_default=True,
            help="Assistant max_tokens per turn at scale 1 (scaled with --scale).",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _kv(pairs: tuple[str, ...], what: str) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; VALUE parsed as JSON when it is JSON (numbers, booleans), else kept a string."""
    out: dict[str, Any] = {}
    for p in pairs:
        if "=" not in p:
            raise click.BadParameter(f"{p!r} is not KEY=VALUE", param_hint=what)
        k, v = p.split("=", 1)
        try:
            out[k.strip().replace("-", "_")] = json.loads(v)
        except ValueError:
            out[k.strip().replace("-", "_")] = v
    return out


@click.group("bench")
def bench_group() -> None:
    """Benchmarks: replay an RL rollout step (Gym-like client) against engines and routers."""


@bench_group.command("trace")
@_workload_options
@click.option(
    "--out",
    "out",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="JSONL file to write (.gz compresses).",
)
def trace_command(
    workload: str, seed: int, scale: float, group_size: int, turn_scale: float, max_tokens: int, out: Path
) -> None:
    """Generate a replay trace and save it, so every arm (and later runs) replay the same requests."""
    trace = generate(workload, seed, scale, group_size, turn_scale=turn_scale, max_tokens=max_tokens)
    save_trace(trace, out)
    click.echo(json.dumps({"out": str(out), **trace_stats(trace)}, indent=1))


@bench_group.command("replay")
@_workload_options
@click.argument("arms", nargs=-1)
@click.option(
    "--trace",
    "trace_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Replay this saved trace instead of generating one.",
)
@click.option(
    "--compare",
    is_flag=True,
    help="Run the ARMS given after it (direct and/or router policies) on fresh simulated fleets.",
)
@click.option("--url", help="Replay against this running router (base URL, with or without /v1).")
@click.option("--label", default="router", show_default=True, help="Arm name for the --url arm.")
@click.option(
    "--engine-url",
    "engine_urls",
    multiple=True,
    help="An engine (repeatable): the direct arm's targets, and whose /metrics are read.",
)
@click.option(
    "--engines",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Simulated engines per arm with --compare.",
)
@click.option("--sim-speed", type=float, default=None, help="Simulator speed factor (passed as speed=).")
@click.option(
    "--sim-process",
    is_flag=True,
    help="Run each simulated fleet and each router in child processes (keeps their CPU off the "
    "client's GIL, as in production).",
)
@click.option("--sim-opt", multiple=True, help="Extra simulator option KEY=VALUE (repeatable).")
@click.option("--router-opt", multiple=True, help="Extra RouterConfig field KEY=VALUE (repeatable).")
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Run the arm list this many times (interleaved), to see the noise floor.",
)
@click.option(
    "--max-concurrent",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Sessions in flight at once; 0 starts them all together, as a Gym step does.",
)
@click.option("--session-header", is_flag=True, help="Send X-Session-ID (nemo-gym 0.7.0 does not).")
@click.option("--model", default=None, help="Model name to send (default: first of GET /v1/models).")
@click.option(
    "--api-key",
    envvar="RL_POLICY_API_KEY",
    default=None,
    help="Bearer token for the client's requests (env RL_POLICY_API_KEY, which the launcher sets: "
    "a key in argv would be readable by every user in ps).",
)
@click.option("--retry-attempts", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--retry-delay", type=click.FloatRange(min=0), default=0.5, show_default=True)
@click.option(
    "--request-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=600.0,
    show_default=True,
    help="Per attempt (Gym has none; a bound keeps a dead fleet from hanging the run).",
)
@click.option(
    "--max-wall",
    type=click.FloatRange(min=0, min_open=True),
    default=3600.0,
    show_default=True,
    help="Give up on unfinished sessions after this many seconds per arm (counted as errors).",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--png", "png_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--results-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help=(
        "Where outputs not given explicitly go "
        f"[default: $RL_JOB_DIR/bench inside a job, else {DEFAULT_RESULTS_DIR}]."
    ),
)
@click.option(
    "--refit-at",
    type=click.FloatRange(min=0, max=1, min_open=True),
    default=None,
    help="With --url inside a job: once this fraction of sessions ended, pause the fleet (keep), hold "
    "--refit-hold seconds, reset caches, stamp a version and resume (the refit window mid-step).",
)
@click.option("--refit-hold", type=click.FloatRange(min=0), default=1.0, show_default=True)
@click.option(
    "--job-dir",
    "refit_job_dir",
    envvar="RL_JOB_DIR",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The job whose router --refit-at drives (env RL_JOB_DIR, set inside a job).",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def replay_command(
    workload: str,
    seed: int,
    scale: float,
    group_size: int,
    turn_scale: float,
    max_tokens: int,
    arms: tuple[str, ...],
    trace_file: Path | None,
    compare: bool,
    url: str | None,
    label: str,
    engine_urls: tuple[str, ...],
    engines: int,
    sim_speed: float | None,
    sim_process: bool,
    sim_opt: tuple[str, ...],
    router_opt: tuple[str, ...],
    repeats: int,
    max_concurrent: int,
    session_header: bool,
    model: str | None,
    api_key: str | None,
    retry_attempts: int,
    retry_delay: float,
    request_timeout: float,
    max_wall: float,
    json_path: Path | None,
    csv_path: Path | None,
    png_path: Path | None,
    results_dir: Path | None,
    refit_at: float | None,
    refit_hold: float,
    refit_job_dir: Path | None,
    quiet: bool,
) -> None:
    """Replay a rollout step and report wall clock, time to 50/90/100%, prefix hits and load spread.

    \b
    Modes:
      --compare ARM...        each arm on a fresh simulated fleet of --engines (arms: direct,
                              round_robin, least_outstanding, consistent_hash, cache_aware)
      --url URL               one arm against a running router (engines from --engine-url or /workers)
      --engine-url U [...]    direct arm against running engines (or ARMS, each via a fresh router)
    """
    from rich.console import Console

    console = Console(stderr=True, soft_wrap=True)
    arm_list = [a for spec in arms for a in spec.split(",") if a]
    if url and (arm_list or compare):
        raise click.UsageError(
            "--url runs one arm against that router; do not combine it with ARMS/--compare"
        )
    if not url and not engine_urls and not arm_list:
        arm_list = [DIRECT, "cache_aware"]
    if arm_list:
        try:
            validate_arms(arm_list)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="ARMS") from None

    trace: Trace = (
        load_trace(trace_file)
        if trace_file
        else generate(workload, seed, scale, group_size, turn_scale=turn_scale, max_tokens=max_tokens)
    )
    stats = trace_stats(trace)
    console.print(
        f"[bold]trace[/] {stats['workload']} seed={stats['seed']} scale={stats['scale']}: "
        f"{stats['sessions']} sessions, {stats['requests']} requests, turns "
        f"{stats['turns_min']}/{stats['turns_p50']}/{stats['turns_p90']}/{stats['turns_p99']}/{stats['turns_max']}"
        f" (min/p50/p90/p99/max), fingerprint {stats['fingerprint']}"
    )
    config = ClientConfig(
        model=model or "",
        session_header=session_header,
        max_concurrent=max_concurrent,
        retry=RetryPolicy(attempts=retry_attempts, delay_s=retry_delay),
        request_timeout_s=request_timeout,
        max_wall_s=max_wall,
        api_key=api_key,
    )
    sim_options = _kv(sim_opt, "--sim-opt")
    if sim_speed is not None:
        sim_options["speed"] = sim_speed
    router_options = _kv(router_opt, "--router-opt")

    progress, on_arm_start, on_session_end = _progress(console, len(trace.sessions), quiet)
    if url and not engine_urls:
        engine_urls = tuple(job_engine_urls())
    refit = None
    if refit_at is not None:
        if not url or refit_job_dir is None:
            raise click.UsageError("--refit-at drives a running job's router: give --url and --job-dir")
        from launcher.bench.refit import MidStepRefit

        refit = MidStepRefit(refit_job_dir, len(trace.sessions), refit_at, refit_hold, console.print)
        on_session_end = refit.wrap(on_session_end)
        try:
            refit.start()
        except (ValueError, OSError) as exc:
            raise click.ClickException(f"--refit-at: {exc}") from None
    try:
        outcomes = _run_arms(
            trace,
            url=url,
            label=label,
            arm_list=arm_list,
            engine_urls=list(engine_urls),
            engines=engines,
            repeats=repeats,
            config=config,
            sim_options=sim_options,
            sim_process=sim_process,
            router_options=router_options,
            console=console,
            on_arm_start=on_arm_start,
            on_session_end=on_session_end,
            progress=progress,
        )
    except (ValueError, RuntimeError, OSError) as exc:  # bad option, fleet or router failed to start
        raise click.ClickException(str(exc)) from exc
    finally:
        refit_result = refit.finish() if refit is not None else None
    run_config: dict[str, Any] = {
        "mode": "url" if url else ("engines" if engine_urls else "sim"),
        "url": url,
        "engine_urls": list(engine_urls),
        "engines": len(engine_urls) or (None if url else engines),
        "arms": [label] if url else arm_list,
        "repeats": repeats,
        "sim_options": sim_options,
        "sim_process": sim_process,
        "router_options": router_options,
        "client": {
            "model": model,
            "max_concurrent": max_concurrent,
            "session_header": session_header,
            "retry_attempts": retry_attempts,
            "retry_delay_s": retry_delay,
            "request_timeout_s": request_timeout,
            "max_wall_s": max_wall,
        },
        "trace_file": str(trace_file) if trace_file else None,
        "refit": refit_result,
    }
    rows = _write_outputs(
        trace,
        stats,
        outcomes,
        run_config,
        results_dir or default_results_dir(),
        json_path,
        csv_path,
        png_path,
        console,
    )
    if refit_result is not None and not refit_result.get("ok"):
        console.print(f"[red]the mid-step refit failed:[/] {refit_result.get('error')}")
        sys.exit(1)
    if any(r["sessions_ok"] == 0 for r in rows):
        console.print("[red]an arm completed no session at all[/] (see errors; is the URL right?)")
        sys.exit(1)


def _run_arms(
    trace: Trace,
    *,
    url: str | None,
    label: str,
    arm_list: list[str],
    engine_urls: list[str],
    engines: int,
    repeats: int,
    config: ClientConfig,
    sim_options: dict[str, Any],
    sim_process: bool,
    router_options: dict[str, Any],
    console: Any,
    on_arm_start: Any,
    on_session_end: Any,
    progress: Any,
) -> list[ArmOutcome]:
    """The arms, ``repeats`` times over (interleaved, so drift hits every arm alike)."""
    outcomes: list[ArmOutcome] = []
    with progress:
        for rep in range(repeats):
            if url:
                on_arm_start(label)
                got = [
                    run_url(
                        trace,
                        url,
                        dataclasses.replace(config),
                        engine_urls=engine_urls or None,
                        arm=label,
                        on_session_end=on_session_end,
                    )
                ]
            elif engine_urls and arm_list in ([], [DIRECT]):
                on_arm_start(DIRECT)
                got = [
                    run_direct(
                        trace, list(engine_urls), dataclasses.replace(config), on_session_end=on_session_end
                    )
                ]
            elif engine_urls:
                console.print(
                    "[yellow]note:[/] arms share the given engines; their caches are not reset between arms"
                )
                got = _compare_on_engines(
                    trace, arm_list, list(engine_urls), config, router_options, on_arm_start, on_session_end
                )
            else:
                got = run_compare(
                    trace,
                    arm_list,
                    engines,
                    config,
                    sim_options=sim_options,
                    router_options=router_options,
                    sim_process=sim_process,
                    on_arm_start=on_arm_start,
                    on_session_end=on_session_end,
                )
            for o in got:
                o.row["repeat"] = rep
                if repeats > 1:
                    o.arm = f"{o.arm}#{rep}"
            outcomes.extend(got)

    for o in outcomes:
        o.row["arm"] = o.arm  # "cache_aware#1" with --repeats; "policy" keeps the bare name
    return outcomes


def _write_outputs(
    trace: Trace,
    stats: dict[str, Any],
    outcomes: list[ArmOutcome],
    run_config: dict[str, Any],
    results_dir: Path,
    json_path: Path | None,
    csv_path: Path | None,
    png_path: Path | None,
    console: Any,
) -> list[dict[str, Any]]:
    """JSON, CSV and PNG (default paths under ``results_dir``), then the table on stdout."""
    from rich.console import Console

    rows = [o.row for o in outcomes]
    if run_config["engines"] is None:  # --url: as many as the router's /workers listed
        run_config["engines"] = next((r["engines"] for r in rows if r.get("engines")), None)
    paths = default_paths(results_dir, trace.workload)
    json_path, csv_path, png_path = (
        json_path or paths["json"],
        csv_path or paths["csv"],
        png_path or paths["png"],
    )
    timelines = {o.arm: o.timeline for o in outcomes}
    write_json(json_path, rows, trace_stats=stats, config=run_config, timelines=timelines)
    write_csv(csv_path, rows)
    title = f"{trace.workload} scale={trace.scale} seed={trace.seed}, {run_config['engines']} engines"
    write_png(png_path, timelines, {o.arm: o.n_sessions for o in outcomes}, title)
    out = Console()
    if not out.is_terminal:  # piped or logged: do not squeeze the table into 80 columns
        out = Console(width=160)
    out.print(render_table(rows, title=f"rollout replay: {title}"))
    console.print(f"wrote {json_path}, {csv_path}, {png_path}")
    return rows


def _compare_on_engines(
    trace: Trace,
    arms: list[str],
    engine_urls: list[str],
    config: ClientConfig,
    router_options: dict[str, Any],
    on_arm_start: Any,
    on_session_end: Any,
) -> list[ArmOutcome]:
    """Arms against engines someone else runs: a fresh router per policy arm, same engines throughout."""
    from launcher.bench.arms import router_for

    out: list[ArmOutcome] = []
    for arm in arms:
        on_arm_start(arm)
        cfg = dataclasses.replace(config)
        if arm == DIRECT:
            out.append(run_direct(trace, engine_urls, cfg, on_session_end=on_session_end))
        else:
            with router_for(engine_urls, arm, router_options) as rurl:
                out.append(
                    run_url(trace, rurl, cfg, engine_urls=engine_urls, arm=arm, on_session_end=on_session_end)
                )
    return out


def _progress(console: Any, total: int, quiet: bool) -> tuple[Any, Any, Any]:
    """A rich progress bar (sessions ended per arm) and the two callbacks that drive it."""
    import contextlib

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if quiet:
        return contextlib.nullcontext(), (lambda arm: None), (lambda rec: None)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
    state: dict[str, Any] = {"task": None}

    def on_arm_start(arm: str) -> None:
        state["task"] = progress.add_task(f"{arm:>18}", total=total)

    def on_session_end(rec: SessionRecord) -> None:
        if state["task"] is not None:
            progress.advance(state["task"])

    return progress, on_arm_start, on_session_end


@bench_group.command("virtual")
@_workload_options
@click.argument("arms", nargs=-1)
@click.option("--compare", is_flag=True, help="Accepted for symmetry with `replay`: the ARMS are compared.")
@click.option("--seeds", default=None, help="Comma-separated trace seeds to average over (default: --seed).")
@click.option("--engines", type=click.IntRange(min=1), default=8, show_default=True)
@click.option(
    "--sim-opt", multiple=True, help="Simulator option KEY=VALUE (repeatable); speed is irrelevant."
)
@click.option(
    "--policy-opt", multiple=True, help="Policy option KEY=VALUE for every policy arm (repeatable)."
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path))
def virtual_command(
    workload: str,
    seed: int,
    scale: float,
    group_size: int,
    turn_scale: float,
    max_tokens: int,
    arms: tuple[str, ...],
    compare: bool,
    seeds: str | None,
    engines: int,
    sim_opt: tuple[str, ...],
    policy_opt: tuple[str, ...],
    json_path: Path | None,
) -> None:
    """Replay in virtual time: the simulator's schedulers and the router's policies on one jumping clock.

    No sockets and no sleeping, so a full longtail step takes seconds of CPU and the figures do not move
    between runs: for comparing policies. Times are modelled seconds at speed 1. Confirm with `replay`.
    """
    from launcher.bench.virtual import ORACLE, compare_virtual, mean_rows
    from launcher.engines.sim.config import SimConfig
    from router.policies import make_policy

    arm_list = list(dict.fromkeys(arms))
    if not arm_list:
        raise click.UsageError(
            "name at least one arm (direct or a policy), e.g. --compare direct cache_aware"
        )
    try:
        validate_arms([a for a in arm_list if a != ORACLE])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="ARMS/--compare") from None
    fronts = [a for a in arm_list if front_of(a) is not None]
    if fronts:
        raise click.BadParameter(
            f"{', '.join(fronts)}: virtual time replays the router's own policies only; compare other "
            "fronts with rl-launch bench replay --compare",
            param_hint="ARMS/--compare",
        )
    try:
        seed_list = [int(x) for x in seeds.split(",")] if seeds else [seed]
    except ValueError:
        raise click.BadParameter(
            f"{seeds!r} is not a comma-separated list of integers", param_hint="--seeds"
        ) from None
    sim_options = _kv(sim_opt, "--sim-opt")
    try:
        config = SimConfig(**sim_options)
        config.validate()
    except (TypeError, ValueError) as e:
        raise click.BadParameter(str(e), param_hint="--sim-opt") from None
    policy_options = _kv(policy_opt, "--policy-opt")
    # Build each policy once before any replay, so a bad option fails at once and by name, and an error
    # raised later inside a replay is not mistaken for one.
    for arm in arm_list:
        if arm not in (DIRECT, ORACLE):
            try:
                make_policy(arm, **policy_options)
            except (TypeError, ValueError) as e:
                raise click.BadParameter(f"{arm}: {e}", param_hint="--policy-opt") from None
    per_arm: dict[str, list[dict[str, Any]]] = {a: [] for a in arm_list}
    for s in seed_list:
        trace = generate(workload, s, scale, group_size, turn_scale=turn_scale, max_tokens=max_tokens)
        for row in compare_virtual(trace, arm_list, engines, config, policy_options):
            row["seed"] = s
            per_arm[row["arm"]].append(row)
            click.echo(
                f"seed {s:<3} {row['arm']:<18} wall {row['wall_s']:8.2f}  t90 {row['t90_s'] or 0:7.2f}  "
                f"hit {row['hit_rate']:.4f}  cv {row['load_cv'] or 0:.3f}  moves {row['moves']:4}  "
                f"errors {row['errors']}"
            )
    means = [mean_rows(per_arm[a]) for a in arm_list]
    base = next((m for m in means if m["arm"] == DIRECT), None)
    click.echo(f"\nmean over {len(seed_list)} trace(s):")
    for m in means:
        margin = ""
        if base is not None and m is not base and base["t90_s"] and m["t90_s"] and base["wall_s"]:
            t90 = 100 * (m["t90_s"] / base["t90_s"] - 1)
            wall = 100 * (m["wall_s"] / base["wall_s"] - 1)
            hit = 100 * (m["hit_rate"] - base["hit_rate"])
            margin = f"  vs direct: t90 {t90:+.1f}%  wall {wall:+.1f}%  hit {hit:+.2f} pt"
        click.echo(
            f"  {m['arm']:<18} wall {m['wall_s']:8.2f}  t90 {m['t90_s'] or 0:7.2f}  hit {m['hit_rate']:.4f}  "
            f"cv {m['load_cv'] or 0:.3f} (max {m['load_cv_max'] or 0:.3f})  moves {m['moves']:.1f}{margin}"
        )
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "workload": workload,
            "scale": scale,
            "engines": engines,
            "seeds": seed_list,
            "sim_options": sim_options,
            "policy_options": policy_options,
            "means": means,
            "runs": per_arm,
        }
        json_path.write_text(json.dumps(payload, indent=1))
        click.echo(f"wrote {json_path}")
