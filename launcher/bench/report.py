"""Turn one arm's client records and engine counters into a result row; write the table, JSON, CSV, PNG.

Why these numbers: an RL step waits for its *last* rollout, so the wall clock and the time to 90/100% of
sessions matter more than mean latency (the public replay saw the last 10% of sessions take ~60% of the
wall clock). Prefix-cache hit rate says whether the router kept each session on a warm engine; the
spread of requests per engine (CV, max/min) says whether it paid for that with hot spots.
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from launcher.bench.client import ReplayResult

REQUIRED_KEYS: tuple[str, ...] = (
    "arm",
    "wall_s",
    "t50_s",
    "t90_s",
    "t100_s",
    "hit_rate",
    "engine_requests",
    "load_cv",
    "errors",
)

CSV_COLUMNS: tuple[str, ...] = (
    "arm",
    "policy",
    "engines",
    "sessions",
    "sessions_ok",
    "errors",
    "requests",
    "failed_requests",
    "retries",
    "wall_s",
    "t50_s",
    "t90_s",
    "t100_s",
    "hit_rate",
    "hit_rate_source",
    "engine_requests",
    "engine_requests_source",
    "load_cv",
    "load_spread",
    "peak_in_flight",
    "latency_p50_s",
    "latency_p90_s",
    "latency_p99_s",
    "prompt_tokens",
    "completion_tokens",
    "cpu_client",
    "cpu_router",
    "cpu_fleet",
    "load_avg",
    "warnings",
)


def time_to_fraction(completion_times: Sequence[float], n_sessions: int, q: float) -> float | None:
    """Seconds until ``ceil(q * n)`` sessions had *succeeded*; None if fewer ever did.

    Lost sessions never count as done: a run that drops its slowest rollouts must not look faster.
    """
    need = max(1, math.ceil(q * n_sessions - 1e-9))
    times = sorted(completion_times)
    return float(times[need - 1]) if len(times) >= need else None


def load_stats(counts: Sequence[float]) -> tuple[float | None, float | None]:
    """(coefficient of variation, max/min) of per-engine request counts; None where undefined."""
    if not counts:
        return None, None
    arr = np.asarray(counts, dtype=float)
    mean = float(arr.mean())
    cv = float(arr.std() / mean) if mean > 0 else None
    spread = float(arr.max() / arr.min()) if arr.min() > 0 else None
    return cv, spread


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(float(x), nd)


def summarize(
    arm: str,
    result: ReplayResult,
    engine_deltas: Sequence[Mapping[str, float] | None] | None = None,
    *,
    policy: str | None = None,
    engine_urls: Sequence[str] = (),
    client_engine_counts: Sequence[int] | None = None,
) -> dict[str, Any]:
    """One result row. ``engine_deltas`` are per-engine counter increases (see ``metrics.deltas``).

    Requests per engine come from ``vllm:request_success_total`` when every engine exposes it, else from
    ``client_engine_counts`` (the direct arm knows where it sent each request), else stay empty.
    """
    n = len(result.sessions)
    done = result.completion_times()
    lat = np.array([r.latency_s for r in result.requests if r.ok], dtype=float)
    row: dict[str, Any] = {
        "arm": arm,
        "policy": policy or arm,
        "engines": len(engine_urls) or (len(engine_deltas) if engine_deltas else None),
        "sessions": n,
        "sessions_ok": len(done),
        "errors": result.errors,
        "requests": sum(1 for r in result.requests if r.ok),
        "failed_requests": sum(1 for r in result.requests if not r.ok),
        "retries": result.retries,
        "wall_s": _r(result.wall_s),
        "t50_s": _r(time_to_fraction(done, n, 0.5)),
        "t90_s": _r(time_to_fraction(done, n, 0.9)),
        "t100_s": _r(time_to_fraction(done, n, 1.0)),
        "hit_rate": None,
        "hit_rate_source": None,
        "engine_requests": [],
        "engine_requests_source": None,
        "load_cv": None,
        "load_spread": None,
        "peak_in_flight": result.peak_in_flight,
        "latency_p50_s": _r(float(np.percentile(lat, 50)) if lat.size else None),
        "latency_p90_s": _r(float(np.percentile(lat, 90)) if lat.size else None),
        "latency_p99_s": _r(float(np.percentile(lat, 99)) if lat.size else None),
        "prompt_tokens": sum(r.prompt_tokens for r in result.requests),
        "completion_tokens": sum(r.completion_tokens for r in result.requests),
    }
    ds = list(engine_deltas or [])
    have = [d for d in ds if d is not None]
    queries = sum(d.get("vllm:prefix_cache_queries_total", 0.0) for d in have)
    hits = sum(d.get("vllm:prefix_cache_hits_total", 0.0) for d in have)
    if have and queries > 0:
        row["hit_rate"] = round(hits / queries, 4)
        row["hit_rate_source"] = "metrics" if len(have) == len(ds) else "metrics (partial)"
    if ds and all(d is not None and "vllm:request_success_total" in d for d in ds):
        row["engine_requests"] = [round(d["vllm:request_success_total"]) for d in ds if d is not None]
        row["engine_requests_source"] = "metrics"
    elif client_engine_counts is not None:
        row["engine_requests"] = [int(c) for c in client_engine_counts]
        row["engine_requests_source"] = "client"
    cv, spread = load_stats(row["engine_requests"])
    row["load_cv"], row["load_spread"] = _r(cv, 4), _r(spread, 3)
    return row


# ----------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------
def _fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    m, s = divmod(float(x), 60.0)
    return f"{int(m)}:{s:05.2f}" if m else f"{s:.2f}s"


def _fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def render_table(rows: Sequence[Mapping[str, Any]], title: str = "rollout replay") -> Any:
    """A rich Table (returned, so callers and tests can print or capture it)."""
    from rich.table import Table

    t = Table(title=title)
    for col, just in (
        ("arm", "left"),
        ("wall", "right"),
        ("t50", "right"),
        ("t90", "right"),
        ("t100", "right"),
        ("prefix hit", "right"),
        ("req/engine min-max", "right"),
        ("CV", "right"),
        ("spread", "right"),
        ("errors", "right"),
        ("retries", "right"),
        ("peak in-flight", "right"),
        ("lat p50/p99", "right"),
    ):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in rows:
        er = r.get("engine_requests") or []
        t.add_row(
            str(r["arm"]),
            _fmt_s(r.get("wall_s")),
            _fmt_s(r.get("t50_s")),
            _fmt_s(r.get("t90_s")),
            _fmt_s(r.get("t100_s")),
            _fmt_pct(r.get("hit_rate")),
            f"{min(er)}-{max(er)}" if er else "-",
            _fmt_pct(r.get("load_cv")),
            "-" if r.get("load_spread") is None else f"{r['load_spread']:.2f}x",
            str(r.get("errors", "-")),
            str(r.get("retries", "-")),
            str(r.get("peak_in_flight", "-")),
            "-" if r.get("latency_p50_s") is None else f"{r['latency_p50_s']:.3f}/{r['latency_p99_s']:.3f}s",
        )
    return t


def default_paths(results_dir: str | Path, workload: str) -> dict[str, Path]:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(results_dir) / f"replay-{workload}-{stamp}"
    return {
        "json": base.with_suffix(".json"),
        "csv": base.with_suffix(".csv"),
        "png": base.with_suffix(".png"),
    }


def write_json(
    path: str | Path,
    rows: Sequence[Mapping[str, Any]],
    *,
    trace_stats: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    timelines: Mapping[str, Sequence[float]] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """``{"rows": [...], "trace": {...}, "config": {...}, "timelines": {arm: [end times]}}``, plus
    ``extra``'s keys (the run's ``warnings``, the ``record`` a trace came from, ``engine_load``)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "kind": "rl-launch bench replay",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "rows": list(rows),
        "trace": dict(trace_stats or {}),
        "config": dict(config or {}),
        "timelines": {k: [round(float(t), 4) for t in v] for k, v in (timelines or {}).items()},
        **dict(extra or {}),
    }
    p.write_text(json.dumps(doc, indent=1) + "\n")
    return p


def write_csv(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """One line per arm; the per-engine list is ``;``-joined so the file stays one table."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(CSV_COLUMNS), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            out = {k: r.get(k) for k in CSV_COLUMNS}
            out["engine_requests"] = ";".join(str(x) for x in (r.get("engine_requests") or []))
            cpu = r.get("cpu") or {}
            for role in ("client", "router", "fleet"):
                out[f"cpu_{role}"] = (cpu.get("processes") or {}).get(role, {}).get("cores")
            out["load_avg"] = cpu.get("load_avg")
            out["warnings"] = " | ".join(r.get("warnings") or []) or None
            w.writerow({k: "" if v is None else v for k, v in out.items()})
    return p


def write_png(
    path: str | Path, timelines: Mapping[str, Sequence[float]], n_sessions: Mapping[str, int], title: str
) -> Path:
    """Sessions done (%) over time, one step line per arm, with the 50% and 90% marks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    try:
        for arm, times in timelines.items():
            n = max(1, n_sessions.get(arm, len(times)))
            ts = sorted(times)
            xs = [0.0, *ts]
            ys = [0.0, *(100.0 * (i + 1) / n for i in range(len(ts)))]
            ax.step(xs, ys, where="post", label=f"{arm} ({len(ts)}/{n})")
        for y in (50, 90):
            ax.axhline(y, color="grey", lw=0.6, ls=":")
        ax.set_xlabel("seconds since the step started")
        ax.set_ylabel("sessions done (%)")
        ax.set_ylim(0, 102)
        ax.set_xlim(left=0)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(p)
    finally:
        plt.close(fig)
    return p


def _steps(intervals: Sequence[tuple[float, float]]) -> tuple[list[float], list[int]]:
    """How many of ``intervals`` (start, end) are open over time, as step-plot points."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    xs, ys, cur = [0.0], [0], 0
    for t, d in events:
        cur += d
        xs.append(t)
        ys.append(cur)
    return xs, ys


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_timeline_png(path: str | Path, outcomes: Sequence[Any], title: str, recorded: Any = None) -> Path:
    """The step's timeline, one line per arm (and the recorded step's, dashed, when replaying a
    record): requests in flight at the client over time, and sessions finished over time. Where the
    recorded line and an arm's part is where the replay did not reproduce the step (or the policy
    changed it)."""
    plt = _plt()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), dpi=110, sharex=True)
    try:
        if recorded is not None:
            xs, ys = _steps([(a, b) for a, b, _ in recorded.requests])
            top.step(xs, ys, where="post", color="black", ls="--", lw=1, label="recorded")
            ends = sorted(recorded.session_ends)
            bottom.step([0.0, *ends], list(range(len(ends) + 1)), where="post", color="black", ls="--", lw=1)
        for o in outcomes:
            reqs = [(r.start_s, r.start_s + r.latency_s) for r in o.result.requests]
            xs, ys = _steps(reqs)
            top.step(xs, ys, where="post", lw=1, label=o.arm)
            ends = sorted(o.timeline)
            bottom.step([0.0, *ends], list(range(len(ends) + 1)), where="post", lw=1, label=o.arm)
        top.set_ylabel("requests in flight")
        top.set_title(title)
        top.grid(alpha=0.3)
        top.legend(loc="upper right")
        bottom.set_ylabel("sessions finished")
        bottom.set_xlabel("seconds since the step started")
        bottom.set_xlim(left=0)
        bottom.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(p)
    finally:
        plt.close(fig)
    return p


def write_engines_png(path: str | Path, outcomes: Sequence[Any], title: str, recorded: Any = None) -> Path:
    """Each engine's load over time (requests running + waiting, read from the engines every sample
    interval), one panel per arm, one line per engine; the recorded step's panel first when the record
    names the engines. A hot spot is one line far above the others."""
    plt = _plt()
    panels: list[tuple[str, list[float], list[list[float]]]] = []
    if recorded is not None and any(e for _, _, e in recorded.requests):
        names = sorted({e for _, _, e in recorded.requests if e})
        end = max((b for _, b, _ in recorded.requests), default=0.0)
        grid = np.linspace(0.0, end, 401)
        per = []
        for name in names:
            starts = np.sort([a for a, _, e in recorded.requests if e == name])
            ends = np.sort([b for _, b, e in recorded.requests if e == name])
            open_ = np.searchsorted(starts, grid, "right") - np.searchsorted(ends, grid, "right")
            per.append(open_.astype(float).tolist())
        panels.append(("recorded", grid.tolist(), per))
    for o in outcomes:
        samples = o.engine_load
        ts = [t for t, _ in samples]
        n = max((len(v) for _, v in samples), default=0)
        nan = float("nan")  # an engine that did not answer a scrape: a gap in its line, not a zero
        per = [[nan if i >= len(v) or v[i] is None else float(v[i]) for _, v in samples] for i in range(n)]
        panels.append((o.arm, ts, per))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(
        max(1, len(panels)),
        1,
        figsize=(9, 2.2 * max(1, len(panels)) + 0.8),
        dpi=110,
        sharex=True,
        squeeze=False,
    )
    try:
        for ax, (name, ts, per) in zip(axes[:, 0], panels, strict=False):
            if not ts:
                ax.text(
                    0.5, 0.5, "no engine load read (no engine metrics)", ha="center", transform=ax.transAxes
                )
            for i, ys in enumerate(per):
                ax.plot(ts, ys, lw=0.8, label=f"engine {i}" if name != "recorded" else None)
            ax.set_ylabel(f"{name}\nrequests")
            ax.grid(alpha=0.3)
        axes[0, 0].set_title(f"{title}: requests on each engine")
        axes[-1, 0].set_xlabel("seconds since the step started")
        axes[-1, 0].set_xlim(left=0)
        fig.tight_layout()
        fig.savefig(p)
    finally:
        plt.close(fig)
    return p


def slowest_sessions(sessions: Sequence[Any], top: int = 8) -> list[dict[str, Any]]:
    """The replay's slowest sessions (start to end, lost ones included at the time they stopped): the
    tail a user chases; ``rl-launch status`` names the same sessions from the router's record (by the
    hash of their ``X-Session-ID`` when the replay sends one, ``--session-header``)."""
    done = [x for x in sessions if x.start_s is not None and x.end_s is not None]
    done.sort(key=lambda x: x.end_s - x.start_s, reverse=True)
    return [
        {"session": x.id, "span_s": round(x.end_s - x.start_s, 3), "turns": x.turns_done, "ok": x.ok}
        for x in done[:top]
    ]
