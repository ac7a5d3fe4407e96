"""``rl-launch bench``: make replay traces and replay them against the fleet, a router, or simulated arms.

Only the command definitions: options, checks of what they combine to, and what is printed. The options
the commands share are defined once in ``bench_flags``. The work is in ``launcher.bench`` (``workload``
makes traces, ``replay_run`` takes a replay or virtual run from its trace to its figures, ``replay`` runs
the arms and writes the outputs, ``virtual`` replays in virtual time), which tests and notebooks use
without click.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from launcher.bench.arms import DIRECT, front_of, validate_arms
from launcher.bench.recorded import RecordedStep
from launcher.bench.replay import DEFAULT_RESULTS_DIR, progress_bar
from launcher.bench.replay_run import (
    replay_plan,
    run_replay,
    trace_line,
    virtual_seeds,
    virtual_trace,
    write_replay,
)
from launcher.bench.trace import save_trace, trace_stats
from launcher.bench.workload import generate
from launcher.cli.bench_flags import (
    ARMS_ARGUMENT,
    JSON_FLAG,
    TRACE_FLAGS,
    WORKLOAD_FLAGS,
    apply,
    kv,
    load_trace_arg,
)


@click.group("bench")
def bench_group() -> None:
    """Benchmarks: replay an RL rollout step (Gym-like client) against engines and routers."""


@bench_group.command("trace")
@apply(WORKLOAD_FLAGS)
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
@apply(WORKLOAD_FLAGS)
@ARMS_ARGUMENT
@apply(TRACE_FLAGS)
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
    "--sim-process/--sim-in-process",
    default=True,
    show_default=True,
    help="Run each simulated fleet and each router in child processes (the default: in the client's "
    "process they share its GIL, and on few cores its CPU, and an arm measures the harness). "
    "--sim-in-process is for debugging; its figures do not compare routers.",
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
@JSON_FLAG
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
    trace_arg: str | None,
    root: Path,
    infer_sessions: bool,
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
                              round_robin, least_outstanding, consistent_hash, cache_aware, and
                              the other fronts' arms: vllm-router[:POLICY], ray-serve[:POLICY]...)
      --url URL               one arm against a running router (engines from --engine-url or /workers)
      --engine-url U [...]    direct arm against running engines (or ARMS, each via a fresh router)

    \b
    --trace JOB replays what a job's router recorded (its sessions, arrivals, prompt and answer
    lengths and shared prefixes) against any of these; the report says what the record skipped.
    Each arm reports the CPU its processes used and warns when they, or the machine's load, may
    have set its times instead of the routing.
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

    recorded: RecordedStep | None = None
    trace_file: Path | None = None
    if trace_arg:
        trace, recorded, trace_file = load_trace_arg(trace_arg, root, infer_sessions)
    else:
        trace = generate(workload, seed, scale, group_size, turn_scale=turn_scale, max_tokens=max_tokens)
    stats = trace_stats(trace)
    console.print(trace_line(stats))
    sim_options = kv(sim_opt, "--sim-opt")
    router_options = kv(router_opt, "--router-opt")
    plan = replay_plan(
        model=model,
        session_header=session_header,
        max_concurrent=max_concurrent,
        retry_attempts=retry_attempts,
        retry_delay=retry_delay,
        request_timeout=request_timeout,
        max_wall=max_wall,
        api_key=api_key,
        url=url,
        label=label,
        arms=arm_list,
        engine_urls=engine_urls,
        engines=engines,
        repeats=repeats,
        sim_options=sim_options,
        sim_speed=sim_speed,
        sim_process=sim_process,
        router_options=router_options,
        sample_load=png_path is not None,
    )
    if not sim_process:
        console.print(
            "[yellow]note:[/] --sim-in-process: the fleet and the routers share this process (and its "
            "GIL) with the client; figures measure the harness too, and do not compare routers"
        )
    progress = progress_bar(console, len(trace.sessions), quiet)
    refit = None
    if refit_at is not None:
        if not url or refit_job_dir is None:
            raise click.UsageError("--refit-at drives a running job's router: give --url and --job-dir")
        from launcher.bench.refit import MidStepRefit

        refit = MidStepRefit(refit_job_dir, len(trace.sessions), refit_at, refit_hold, console.print)
        try:
            refit.start()
        except (ValueError, OSError) as exc:
            raise click.ClickException(f"--refit-at: {exc}") from None
    try:
        outcomes, refit_result = run_replay(trace, plan, console, progress, refit)
    except (ValueError, RuntimeError, OSError) as exc:  # bad option, fleet or router failed to start
        raise click.ClickException(str(exc)) from exc
    rows = write_replay(
        trace,
        stats,
        outcomes,
        plan,
        refit_result,
        console,
        trace_file=trace_file,
        recorded=recorded,
        results_dir=results_dir,
        json_path=json_path,
        csv_path=csv_path,
        png_path=png_path,
    )
    if refit_result is not None and not refit_result.get("ok"):
        console.print(f"[red]the mid-step refit failed:[/] {refit_result.get('error')}")
        sys.exit(1)
    if any(r["sessions_ok"] == 0 for r in rows):
        console.print("[red]an arm completed no session at all[/] (see errors; is the URL right?)")
        sys.exit(1)


@bench_group.command("virtual")
@apply(WORKLOAD_FLAGS)
@ARMS_ARGUMENT
@apply(TRACE_FLAGS)
@click.option("--compare", is_flag=True, help="Accepted for symmetry with `replay`: the ARMS are compared.")
@click.option("--seeds", default=None, help="Comma-separated trace seeds to average over (default: --seed).")
@click.option("--engines", type=click.IntRange(min=1), default=8, show_default=True)
@click.option(
    "--sim-opt", multiple=True, help="Simulator option KEY=VALUE (repeatable); speed is irrelevant."
)
@click.option(
    "--policy-opt", multiple=True, help="Policy option KEY=VALUE for every policy arm (repeatable)."
)
@JSON_FLAG
def virtual_command(
    workload: str,
    seed: int,
    scale: float,
    group_size: int,
    turn_scale: float,
    max_tokens: int,
    arms: tuple[str, ...],
    trace_arg: str | None,
    root: Path,
    infer_sessions: bool,
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
    --trace replays a saved trace or a job's recorded step (its arrivals and tool gaps on the virtual
    clock) instead of generated ones.
    """
    from launcher.bench.virtual import ORACLE
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
    if trace_arg and seeds:
        raise click.UsageError(
            "--trace replays one trace; --seeds draws generated ones (give one or the other)"
        )
    try:
        seed_list = [int(x) for x in seeds.split(",")] if seeds else [seed]
    except ValueError:
        raise click.BadParameter(
            f"{seeds!r} is not a comma-separated list of integers", param_hint="--seeds"
        ) from None
    sim_options = kv(sim_opt, "--sim-opt")
    try:
        config = SimConfig(**sim_options)
        config.validate()
    except (TypeError, ValueError) as e:
        raise click.BadParameter(str(e), param_hint="--sim-opt") from None
    policy_options = kv(policy_opt, "--policy-opt")
    # Build each policy once before any replay, so a bad option fails at once and by name, and an error
    # raised later inside a replay is not mistaken for one.
    for arm in arm_list:
        if arm not in (DIRECT, ORACLE):
            try:
                make_policy(arm, **policy_options)
            except (TypeError, ValueError) as e:
                raise click.BadParameter(f"{arm}: {e}", param_hint="--policy-opt") from None
    if trace_arg:
        trace, recorded, path = load_trace_arg(trace_arg, root, infer_sessions)
        virtual_trace(trace, recorded, path, arm_list, engines, config, policy_options, json_path, click.echo)
        return
    trace_args = {
        "workload": workload,
        "scale": scale,
        "group_size": group_size,
        "turn_scale": turn_scale,
        "max_tokens": max_tokens,
    }
    virtual_seeds(
        trace_args, seed_list, arm_list, engines, config, sim_options, policy_options, json_path, click.echo
    )
