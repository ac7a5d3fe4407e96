"""Running ``rl-launch bench replay``: the arms (repeated, interleaved), the outputs, the progress bar.

The command (``launcher.cli.bench``) parses options and decides what to run; this module runs it and
writes what it found, so a test or a notebook can drive the same replay without click. Outputs default
into the job directory when the replay runs as a job's training command: a job's files belong there,
never in whatever directory it was submitted from (which Slurm makes the job's cwd).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.bench.arms import DIRECT, ArmOutcome, Watch, run_compare, run_direct, run_url
from launcher.bench.client import ClientConfig, SessionRecord
from launcher.bench.cpu import cpu_line
from launcher.bench.recorded import RecordedStep
from launcher.bench.report import (
    default_paths,
    render_table,
    slowest_sessions,
    write_csv,
    write_engines_png,
    write_json,
    write_png,
    write_timeline_png,
)
from launcher.bench.trace import Trace
from launcher.jobdir.paths import bench_dir

DEFAULT_RESULTS_DIR = "bench/results"
JOB_DIR_ENV = "RL_JOB_DIR"
"""Set by the driver for the training command: a replay run as a job's "training" writes there."""


def default_results_dir() -> Path:
    """``$RL_JOB_DIR/bench`` inside a job, else ``bench/results``: a job's outputs belong in its job
    directory, never in whatever directory it was submitted from (which Slurm makes the job's cwd)."""
    job_dir = os.environ.get(JOB_DIR_ENV)
    return bench_dir(job_dir) if job_dir else Path(DEFAULT_RESULTS_DIR)


def job_engine_key(engine_urls: Sequence[str]) -> str | None:
    """Inside a job (``$RL_JOB_DIR``): the key its engines take, for the counter scrapes of a ``--url``
    replay (the engines refuse the client key), when every one of ``engine_urls`` is one of the job's
    own engines; None otherwise (outside a job, or an engine of someone else's: the engine key is never
    sent to a URL the job did not start)."""
    job_dir = os.environ.get(JOB_DIR_ENV)
    own = {_engine_root(u) for u in job_engine_urls()}
    if not job_dir or not engine_urls or not {_engine_root(u) for u in engine_urls} <= own:
        return None
    from launcher.jobdir import JobDir

    try:
        return JobDir(Path(job_dir)).read_engine_key() or None
    except (OSError, ValueError):
        return None


def _engine_root(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


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


@dataclass
class ReplayPlan:
    """What one ``bench replay`` runs: the arms, against what, with which client (recorded in its JSON).

    Against a running router (``url``: one arm, ``label``), running engines (``engine_urls``: the direct
    arm, or each of ``arms`` through a fresh router) or fresh simulated fleets of ``engines`` each.
    ``sim_process`` (default) runs those fleets and routers in child processes, so an arm measures the
    router and not the replay client's share of one process; False is for debugging. ``sample_s``: how
    often each engine's load is read for the per-engine plot (0: not drawn, not read)."""

    client: ClientConfig
    url: str | None = None
    label: str = "router"
    arms: list[str] = field(default_factory=list)
    engine_urls: list[str] = field(default_factory=list)
    engines: int = 8
    repeats: int = 1
    sim_options: dict[str, Any] = field(default_factory=dict)
    sim_process: bool = True
    router_options: dict[str, Any] = field(default_factory=dict)
    sample_s: float = 0.0

    def run_config(self, trace_file: Path | None, refit: dict[str, Any] | None) -> dict[str, Any]:
        """The ``config`` of the JSON report."""
        c = self.client
        return {
            "mode": "url" if self.url else ("engines" if self.engine_urls else "sim"),
            "url": self.url,
            "engine_urls": list(self.engine_urls),
            "engines": len(self.engine_urls) or (None if self.url else self.engines),
            "arms": [self.label] if self.url else self.arms,
            "repeats": self.repeats,
            "sim_options": self.sim_options,
            "sim_process": self.sim_process,
            "router_options": self.router_options,
            "load_sample_s": self.sample_s or None,
            "client": {
                "model": c.model or None,
                "max_concurrent": c.max_concurrent,
                "session_header": c.session_header,
                "retry_attempts": c.retry.attempts,
                "retry_delay_s": c.retry.delay_s,
                "request_timeout_s": c.request_timeout_s,
                "max_wall_s": c.max_wall_s,
            },
            "trace_file": str(trace_file) if trace_file else None,
            "refit": refit,
        }


def run_arms(
    trace: Trace, plan: ReplayPlan, console: Any, on_arm_start: Any, on_session_end: Any, progress: Any
) -> list[ArmOutcome]:
    """The arms, ``repeats`` times over (interleaved, so drift hits every arm alike)."""
    config, engine_urls, arm_list = plan.client, plan.engine_urls, plan.arms
    watch = Watch(sample_s=plan.sample_s)  # the client's process runs nothing else here
    outcomes: list[ArmOutcome] = []
    with progress:
        for rep in range(plan.repeats):
            if plan.url:
                on_arm_start(plan.label)
                got = [
                    run_url(
                        trace,
                        plan.url,
                        dataclasses.replace(config),
                        engine_urls=engine_urls or None,
                        arm=plan.label,
                        on_session_end=on_session_end,
                        watch=watch,
                    )
                ]
            elif engine_urls and arm_list in ([], [DIRECT]):
                on_arm_start(DIRECT)
                got = [
                    run_direct(
                        trace,
                        list(engine_urls),
                        dataclasses.replace(config),
                        on_session_end=on_session_end,
                        watch=watch,
                    )
                ]
            elif engine_urls:
                console.print(
                    "[yellow]note:[/] arms share the given engines; their caches are not reset between arms"
                )
                got = compare_on_engines(
                    trace,
                    arm_list,
                    list(engine_urls),
                    config,
                    plan.router_options,
                    on_arm_start,
                    on_session_end,
                    process=plan.sim_process,
                    sample_s=plan.sample_s,
                )
            else:
                got = run_compare(
                    trace,
                    arm_list,
                    plan.engines,
                    config,
                    sim_options=plan.sim_options,
                    router_options=plan.router_options,
                    sim_process=plan.sim_process,
                    on_arm_start=on_arm_start,
                    on_session_end=on_session_end,
                    sample_s=plan.sample_s,
                )
            for o in got:
                o.row["repeat"] = rep
                if plan.repeats > 1:
                    o.arm = f"{o.arm}#{rep}"
            outcomes.extend(got)

    for o in outcomes:
        o.row["arm"] = o.arm  # "cache_aware#1" with --repeats; "policy" keeps the bare name
    return outcomes


def write_outputs(
    trace: Trace,
    stats: dict[str, Any],
    outcomes: list[ArmOutcome],
    run_config: dict[str, Any],
    results_dir: Path,
    json_path: Path | None,
    csv_path: Path | None,
    png_path: Path | None,
    console: Any,
    recorded: RecordedStep | None = None,
) -> list[dict[str, Any]]:
    """JSON, CSV and PNG (default paths under ``results_dir``), then the table on stdout, then what the
    CPU did during each arm and a WARNING for whatever may have set an arm's times instead of the
    routing. An explicit ``png_path`` also draws the step's timeline (requests in flight, sessions
    finished) and each engine's load over time beside it (``<stem>-timeline.png``, ``-engines.png``),
    with the recorded step's own lines when the trace came from a record."""
    from rich.console import Console

    rows = [o.row for o in outcomes]
    plots = png_path is not None
    if run_config["engines"] is None:  # --url: as many as the router's /workers listed
        run_config["engines"] = next((r["engines"] for r in rows if r.get("engines")), None)
    paths = default_paths(results_dir, trace.workload)
    json_path, csv_path, png_path = (
        json_path or paths["json"],
        csv_path or paths["csv"],
        png_path or paths["png"],
    )
    timelines = {o.arm: o.timeline for o in outcomes}
    warnings = [f"{o.arm}: {w}" for o in outcomes for w in o.row.get("warnings") or []]
    slowest = {o.arm: slowest_sessions(o.result.sessions) for o in outcomes}
    extra: dict[str, Any] = {"warnings": warnings, "slowest": slowest}
    if recorded is not None:
        extra["record"] = recorded.to_json()
    if plots:
        extra["engine_load"] = {o.arm: o.engine_load for o in outcomes}
    write_json(json_path, rows, trace_stats=stats, config=run_config, timelines=timelines, extra=extra)
    write_csv(csv_path, rows)
    if trace.workload.startswith("recorded"):
        title = f"{trace.workload}, {run_config['engines']} engines"
    else:
        title = f"{trace.workload} scale={trace.scale} seed={trace.seed}, {run_config['engines']} engines"
    written = [write_png(png_path, timelines, {o.arm: o.n_sessions for o in outcomes}, title)]
    if plots:
        written.append(write_timeline_png(_beside(png_path, "timeline"), outcomes, title, recorded))
        written.append(write_engines_png(_beside(png_path, "engines"), outcomes, title, recorded))
    out = Console()
    if not out.is_terminal:  # piped or logged: do not squeeze the table into 80 columns
        out = Console(width=160)
    # The report's lines are printed whole (soft_wrap): wrapped at the console's width, a long record
    # path split "cut short" over two lines of a logged report, where grep no longer finds it.
    if recorded is not None:
        for line in recorded.summary_lines():
            out.print(line, markup=False, highlight=False, soft_wrap=True)
    out.print(render_table(rows, title=f"rollout replay: {title}"))
    for o in outcomes:
        if o.row.get("cpu"):
            out.print(cpu_line(o.arm, o.row["cpu"]), markup=False, highlight=False, soft_wrap=True)
    for arm, rows_ in slowest.items():
        listed = ", ".join(f"{x['session']} {x['span_s']:.1f}s/{x['turns']}t" for x in rows_[:5])
        out.print(f"slowest sessions ({arm}): {listed}", markup=False, highlight=False, soft_wrap=True)
    for w in warnings:
        out.print(f"WARNING {w}", markup=False, highlight=False, style="bold yellow", soft_wrap=True)
    console.print(f"wrote {json_path}, {csv_path}, {', '.join(str(p) for p in written)}", soft_wrap=True)
    return rows


def _beside(png: Path, what: str) -> Path:
    """``out.png`` -> ``out-<what>.png``: the extra plots sit next to the one asked for."""
    return png.with_name(f"{png.stem}-{what}{png.suffix or '.png'}")


def compare_on_engines(
    trace: Trace,
    arms: list[str],
    engine_urls: list[str],
    config: ClientConfig,
    router_options: dict[str, Any],
    on_arm_start: Any,
    on_session_end: Any,
    *,
    process: bool = True,
    sample_s: float = 0.0,
) -> list[ArmOutcome]:
    """Arms against engines someone else runs: a fresh router per policy arm, same engines throughout
    (in a child process unless ``process`` is False, as in ``run_compare``)."""
    from launcher.bench.arms import router_for

    watch = Watch(in_process=not process, sample_s=sample_s)
    out: list[ArmOutcome] = []
    for arm in arms:
        on_arm_start(arm)
        cfg = dataclasses.replace(config)
        if arm == DIRECT:
            out.append(run_direct(trace, engine_urls, cfg, on_session_end=on_session_end, watch=watch))
        else:
            with router_for(engine_urls, arm, router_options, process=process) as rurl:
                out.append(
                    run_url(
                        trace,
                        rurl,
                        cfg,
                        engine_urls=engine_urls,
                        arm=arm,
                        on_session_end=on_session_end,
                        watch=watch,
                    )
                )
    return out


def progress_bar(console: Any, total: int, quiet: bool) -> tuple[Any, Any, Any]:
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
