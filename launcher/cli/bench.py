"""``rl-launch bench``: make replay traces and replay them against the fleet, a router, or simulated arms.

Only the command definitions: options, checks of what they combine to, and what is printed. The work is
in ``launcher.bench`` (``workload`` makes traces, ``replay`` runs the arms and writes the outputs,
``virtual`` replays in virtual time), which tests and notebooks use without click.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from launcher.bench.arms import DIRECT, front_of, validate_arms
from launcher.bench.client import ClientConfig, RetryPolicy
from launcher.bench.recorded import RecordedStep, load_recorded, resolve_trace_source
from launcher.bench.replay import (
    DEFAULT_RESULTS_DIR,
    ReplayPlan,
    default_results_dir,
    job_engine_key,
    job_engine_urls,
    progress_bar,
    run_arms,
    write_outputs,
)
from launcher.bench.trace import Trace, load_trace, save_trace, trace_stats
from launcher.bench.workload import MAX_TOKENS, WORKLOADS, generate
from launcher.cli.options import root_option

if TYPE_CHECKING:
    from launcher.engines.sim.config import SimConfig

WORKLOAD_OPTIONS = ("workload", "seed", "scale", "group_size", "turn_scale", "max_tokens")
"""The options that define a generated trace: given with ``--trace`` they would be silently ignored."""
LOAD_SAMPLE_S = 0.25
"""How often each engine's load is read for ``--png``'s per-engine plot."""


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


def _trace_option(f: Any) -> Any:
    """``--trace JOB_OR_FILE`` and what it needs (``--root``, ``--infer-sessions``), for ``replay`` and
    ``virtual`` alike."""
    opts = [
        click.option(
            "--trace",
            "trace_arg",
            metavar="JOB_OR_FILE",
            default=None,
            help="Replay this instead of a generated workload: a saved trace (bench trace --out), a job "
            "(directory, or name/id under --root) whose router recorded its requests, a record "
            "directory or one record file. Not with --workload.",
        ),
        root_option,
        click.option(
            "--infer-sessions/--no-infer-sessions",
            default=True,
            show_default=True,
            help="Records without a session (Gym sends no session header): join each to the "
            "conversation whose previous prompt it extends (what cache_aware itself sees), instead of "
            "replaying it as a one-turn session, which loses the step's conversations and its hit rate.",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _load_trace_arg(
    trace_arg: str, root: Path, infer_sessions: bool
) -> tuple[Trace, RecordedStep | None, Path]:
    """The trace ``--trace`` names, the record it was built from (None for a saved trace), and its path.
    What cannot be found or read is the command's one-line error."""
    from launcher.jobdir.lookup import JobNotFound

    ctx = click.get_current_context()
    given = [
        "--" + name.replace("_", "-")
        for name in WORKLOAD_OPTIONS
        if ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)
    ]
    if given:
        raise click.UsageError(
            f"--trace replays the requests it names; {', '.join(given)} define a generated workload "
            "(give one or the other)"
        )
    try:
        kind, path = resolve_trace_source(trace_arg, root)
        if kind == "trace":
            return load_trace(path), None, path
        step = load_recorded(path, infer_sessions=infer_sessions)
    except JobNotFound as exc:
        raise click.ClickException(f"--trace: {exc}") from None
    except (OSError, ValueError, KeyError) as exc:
        raise click.ClickException(f"--trace {trace_arg}: {exc}") from None
    return step.trace, step, path


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
@_trace_option
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
        trace, recorded, trace_file = _load_trace_arg(trace_arg, root, infer_sessions)
    else:
        trace = generate(workload, seed, scale, group_size, turn_scale=turn_scale, max_tokens=max_tokens)
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

    if url and not engine_urls:
        engine_urls = tuple(job_engine_urls())
    if url:
        config.engine_key = job_engine_key(engine_urls)
    plan = ReplayPlan(
        config,
        url=url,
        label=label,
        arms=arm_list,
        engine_urls=list(engine_urls),
        engines=engines,
        repeats=repeats,
        sim_options=sim_options,
        sim_process=sim_process,
        router_options=router_options,
        sample_s=LOAD_SAMPLE_S if png_path is not None else 0.0,
    )
    if not sim_process:
        console.print(
            "[yellow]note:[/] --sim-in-process: the fleet and the routers share this process (and its "
            "GIL) with the client; figures measure the harness too, and do not compare routers"
        )
    progress, on_arm_start, on_session_end = progress_bar(console, len(trace.sessions), quiet)
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
        outcomes = run_arms(trace, plan, console, on_arm_start, on_session_end, progress)
    except (ValueError, RuntimeError, OSError) as exc:  # bad option, fleet or router failed to start
        raise click.ClickException(str(exc)) from exc
    finally:
        refit_result = refit.finish() if refit is not None else None
    run_config = plan.run_config(trace_file, refit_result)
    rows = write_outputs(
        trace,
        stats,
        outcomes,
        run_config,
        results_dir or default_results_dir(),
        json_path,
        csv_path,
        png_path,
        console,
        recorded=recorded,
    )
    if refit_result is not None and not refit_result.get("ok"):
        console.print(f"[red]the mid-step refit failed:[/] {refit_result.get('error')}")
        sys.exit(1)
    if any(r["sessions_ok"] == 0 for r in rows):
        console.print("[red]an arm completed no session at all[/] (see errors; is the URL right?)")
        sys.exit(1)


@bench_group.command("virtual")
@_workload_options
@click.argument("arms", nargs=-1)
@_trace_option
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
    from launcher.bench.virtual import ORACLE, compare_virtual_seeds, mean_lines, mean_rows, seed_line
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
    if trace_arg:
        _virtual_trace(trace_arg, root, infer_sessions, arm_list, engines, config, policy_options, json_path)
        return
    trace_args = {
        "workload": workload,
        "scale": scale,
        "group_size": group_size,
        "turn_scale": turn_scale,
        "max_tokens": max_tokens,
    }
    per_arm = compare_virtual_seeds(
        trace_args,
        seed_list,
        arm_list,
        engines,
        config,
        policy_options,
        on_row=lambda row: click.echo(seed_line(row)),
    )
    means = [mean_rows(per_arm[a]) for a in arm_list]
    click.echo(f"\nmean over {len(seed_list)} trace(s):")
    for line in mean_lines(means):
        click.echo(line)
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


def _virtual_trace(
    trace_arg: str,
    root: Path,
    infer_sessions: bool,
    arms: list[str],
    engines: int,
    config: SimConfig,
    policy_options: dict[str, Any],
    json_path: Path | None,
) -> None:
    """``bench virtual --trace``: every arm on the one trace (saved or recorded), one line each."""
    from launcher.bench.virtual import compare_virtual, mean_lines, mean_rows

    trace, recorded, path = _load_trace_arg(trace_arg, root, infer_sessions)
    if recorded is not None:
        for line in recorded.summary_lines():
            click.echo(line)
    stats = trace_stats(trace)
    click.echo(
        f"trace {stats['workload']}: {stats['sessions']} sessions, {stats['requests']} requests, "
        f"fingerprint {stats['fingerprint']}"
    )
    rows = compare_virtual(trace, arms, engines, config, policy_options)
    for line in mean_lines([mean_rows([row]) for row in rows]):
        click.echo(line)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "trace": str(path),
            "trace_stats": stats,
            "record": recorded.to_json() if recorded is not None else None,
            "engines": engines,
            "policy_options": policy_options,
            "rows": rows,
        }
        json_path.write_text(json.dumps(payload, indent=1))
        click.echo(f"wrote {json_path}")
