"""One ``bench replay`` or ``bench virtual`` run, from a chosen trace to the figures written.

The commands (``launcher.cli.bench``) parse and check their options, pick the trace and print; the
orchestration in between (the client config and the plan, the mid-step refit around the arms, the
outputs; every virtual arm over each seed or the one trace, and its JSON) lived in the two commands'
bodies, 155 and 107 lines each behind the same long signature. It is here, without click, so each step
is read (and driven by a test or a notebook) on its own; it raises ``ValueError``/``OSError``/
``RuntimeError`` with the reason, which the commands turn into their one-line errors as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.bench.arms import ArmOutcome
from launcher.bench.client import ClientConfig, RetryPolicy
from launcher.bench.recorded import RecordedStep
from launcher.bench.replay import (
    ReplayPlan,
    default_results_dir,
    job_engine_key,
    job_engine_urls,
    run_arms,
    write_outputs,
)
from launcher.bench.trace import Trace, trace_stats

if TYPE_CHECKING:
    from launcher.bench.refit import MidStepRefit
    from launcher.engines.sim.config import SimConfig

LOAD_SAMPLE_S = 0.25
"""How often each engine's load is read for ``--png``'s per-engine plot."""


def trace_line(stats: dict[str, Any]) -> str:
    """The one line ``bench replay`` prints about its trace (rich markup)."""
    return (
        f"[bold]trace[/] {stats['workload']} seed={stats['seed']} scale={stats['scale']}: "
        f"{stats['sessions']} sessions, {stats['requests']} requests, turns "
        f"{stats['turns_min']}/{stats['turns_p50']}/{stats['turns_p90']}/{stats['turns_p99']}/{stats['turns_max']}"
        f" (min/p50/p90/p99/max), fingerprint {stats['fingerprint']}"
    )


def replay_plan(
    *,
    model: str | None,
    session_header: bool,
    max_concurrent: int,
    retry_attempts: int,
    retry_delay: float,
    request_timeout: float,
    max_wall: float,
    api_key: str | None,
    url: str | None,
    label: str,
    arms: list[str],
    engine_urls: tuple[str, ...],
    engines: int,
    repeats: int,
    sim_options: dict[str, Any],
    sim_speed: float | None,
    sim_process: bool,
    router_options: dict[str, Any],
    sample_load: bool,
) -> ReplayPlan:
    """What the replay runs: the client's config and the arms; a ``--url`` arm's engines (and the key
    they take) from the job it runs in when ``--engine-url`` names none."""
    config = ClientConfig(
        model=model or "",
        session_header=session_header,
        max_concurrent=max_concurrent,
        retry=RetryPolicy(attempts=retry_attempts, delay_s=retry_delay),
        request_timeout_s=request_timeout,
        max_wall_s=max_wall,
        api_key=api_key,
    )
    if sim_speed is not None:
        sim_options["speed"] = sim_speed
    if url and not engine_urls:
        engine_urls = tuple(job_engine_urls())
    if url:
        config.engine_key = job_engine_key(engine_urls)
    return ReplayPlan(
        config,
        url=url,
        label=label,
        arms=arms,
        engine_urls=list(engine_urls),
        engines=engines,
        repeats=repeats,
        sim_options=sim_options,
        sim_process=sim_process,
        router_options=router_options,
        sample_s=LOAD_SAMPLE_S if sample_load else 0.0,
    )


def run_replay(
    trace: Trace,
    plan: ReplayPlan,
    console: Any,
    progress: tuple[Any, Any, Any],
    refit: MidStepRefit | None,
) -> tuple[list[ArmOutcome], dict[str, Any] | None]:
    """Run the plan's arms, the refit (already started) counting the sessions' ends; each arm's outcome
    and the refit's result (None without one), the refit waited for however the arms ended."""
    bar, on_arm_start, on_session_end = progress
    if refit is not None:
        on_session_end = refit.wrap(on_session_end)
    try:
        outcomes = run_arms(trace, plan, console, on_arm_start, on_session_end, bar)
    finally:
        refit_result = refit.finish() if refit is not None else None
    return outcomes, refit_result


def write_replay(
    trace: Trace,
    stats: dict[str, Any],
    outcomes: list[ArmOutcome],
    plan: ReplayPlan,
    refit_result: dict[str, Any] | None,
    console: Any,
    *,
    trace_file: Path | None,
    recorded: RecordedStep | None,
    results_dir: Path | None,
    json_path: Path | None,
    csv_path: Path | None,
    png_path: Path | None,
) -> list[dict[str, Any]]:
    """The report and the files it goes to (defaults under the results directory); the report's rows."""
    run_config = plan.run_config(trace_file, refit_result)
    return write_outputs(
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


def _write_json(json_path: Path, payload: dict[str, Any], echo: Callable[[str], None]) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(payload, indent=1))
    echo(f"wrote {json_path}")


def virtual_seeds(
    trace_args: dict[str, Any],
    seeds: list[int],
    arms: list[str],
    engines: int,
    config: SimConfig,
    sim_options: dict[str, Any],
    policy_options: dict[str, Any],
    json_path: Path | None,
    echo: Callable[[str], None],
) -> None:
    """``bench virtual`` over generated traces: a line per arm and seed, then each arm's mean."""
    from launcher.bench.virtual import compare_virtual_seeds, mean_lines, mean_rows, seed_line

    per_arm = compare_virtual_seeds(
        trace_args, seeds, arms, engines, config, policy_options, on_row=lambda row: echo(seed_line(row))
    )
    means = [mean_rows(per_arm[a]) for a in arms]
    echo(f"\nmean over {len(seeds)} trace(s):")
    for line in mean_lines(means):
        echo(line)
    if json_path is not None:
        payload = {
            "workload": trace_args["workload"],
            "scale": trace_args["scale"],
            "engines": engines,
            "seeds": seeds,
            "sim_options": sim_options,
            "policy_options": policy_options,
            "means": means,
            "runs": per_arm,
        }
        _write_json(json_path, payload, echo)


def virtual_trace(
    trace: Trace,
    recorded: RecordedStep | None,
    path: Path,
    arms: list[str],
    engines: int,
    config: SimConfig,
    policy_options: dict[str, Any],
    json_path: Path | None,
    echo: Callable[[str], None],
) -> None:
    """``bench virtual --trace``: every arm on the one trace (saved or recorded), one line each."""
    from launcher.bench.virtual import compare_virtual, mean_lines, mean_rows

    if recorded is not None:
        for line in recorded.summary_lines():
            echo(line)
    stats = trace_stats(trace)
    echo(
        f"trace {stats['workload']}: {stats['sessions']} sessions, {stats['requests']} requests, "
        f"fingerprint {stats['fingerprint']}"
    )
    rows = compare_virtual(trace, arms, engines, config, policy_options)
    for line in mean_lines([mean_rows([row]) for row in rows]):
        echo(line)
    if json_path is not None:
        payload = {
            "trace": str(path),
            "trace_stats": stats,
            "record": recorded.to_json() if recorded is not None else None,
            "engines": engines,
            "policy_options": policy_options,
            "rows": rows,
        }
        _write_json(json_path, payload, echo)
