"""Turn a status snapshot (``collect``) into one rich renderable: the dashboard's frame.

Rendering reads nothing but the snapshot, so ``--once``, the live view and tests draw the very figures
``--json`` prints. Unknown figures show as ``-``; an engine that did not answer keeps its row, with the
reason in red, because a row that silently disappears is worse than one that says it is blind.
"""

from __future__ import annotations

import time
from typing import Any

from rich.cells import cell_len
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from launcher.status.adapters import adapters_text
from launcher.status.charts import sparkline
from launcher.status.elastic import elastic_text
from launcher.status.refit import refit_line
from launcher.status.rollouts import rollouts_text
from launcher.status.standing import standing_text

STATE_STYLES = {
    "HEALTHY": "bold green",
    "HEALTHY?": "green",
    "SUSPECT": "bold yellow",
    "DEAD": "bold red",
    "RETIRED": "red",
    "RESTARTING": "bold cyan",
    "RECOVERING": "cyan",
    "STALE": "bold magenta",
    "DRAINING": "bold blue",
    "STOPPED": "dim",
}

CONDITION_STYLES = {
    "queued": "yellow",
    "starting": "cyan",
    "unreachable": "red",
    "finished": "green",
}

# Worst first: when the terminal cannot hold every row, these are the rows that must stay on screen.
_SEVERITY = {
    "DEAD": 0,
    "SUSPECT": 1,
    "STALE": 2,
    "RESTARTING": 3,
    "RECOVERING": 4,
    "DRAINING": 5,
    "RETIRED": 6,
}


def fmt_seconds(v: float | None) -> str:
    if v is None:
        return "-"
    if v < 1:
        return f"{v * 1000:.0f} ms"
    return f"{v:.2f} s" if v < 10 else f"{v:.1f} s"


def fmt_latency(value: float | None, below: float | None) -> str:
    """A quantile, or "<bound" when it lies in the histogram's lowest bucket (see collect)."""
    return f"<{fmt_seconds(below)}" if below is not None else fmt_seconds(value)


def fmt_elapsed(v: float | None) -> str:
    if v is None:
        return "-"
    s = int(v)
    days, s = divmod(s, 86400)
    text = f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{days}d {text}" if days else text


def fmt_num(v: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def fmt_count(v: float | None) -> str:
    return "-" if v is None else str(int(v))


def _job_header(snap: dict[str, Any]) -> Text:
    job = snap["job"]
    t = Text()
    t.append("job ", style="dim")
    t.append(str(job["name"]), style="bold")
    t.append("  slurm ", style="dim")
    t.append(str(job.get("slurm_state") or "-"))
    t.append("  phase ", style="dim")
    t.append(str(job.get("phase") or "-"), style="bold")
    t.append("  elapsed ", style="dim")
    t.append(fmt_elapsed(job.get("elapsed_s")))
    nodes = job.get("nodes") or {}
    if isinstance(nodes, dict) and nodes:
        for role, names in nodes.items():
            names = names if isinstance(names, list) else [names]
            shown = ",".join(map(str, names[:4])) + (f",+{len(names) - 4}" if len(names) > 4 else "")
            t.append(f"  {role} ", style="dim")
            t.append(shown)
    if job.get("front") or job.get("engines"):  # the kinds' own words (launcher.gateways.front ...)
        t.append("\nfront ", style="dim")
        t.append(str(job.get("front") or "-"))
        t.append("  engines ", style="dim")
        t.append(str(job.get("engines") or "-"))
    if job.get("router_url"):
        t.append("\nrouter url ", style="dim")
        t.append(str(job["router_url"]), style="underline")
        if job.get("policy") and not job.get("front"):
            t.append(f"  policy {job['policy']}", style="dim")
    return t


def _router_line(snap: dict[str, Any], width: int | None = None) -> Text:
    r = snap["router"]
    t = Text()
    if r.get("reachable") is False:
        t.append("router ", style="dim")
        t.append(f"unreachable: {r.get('error')}", style="bold red")
        return t
    figures = [
        ("req/s", fmt_num(r.get("req_per_s"))),
        ("in-flight", fmt_count(r.get("in_flight"))),
        ("p50", fmt_latency(r.get("p50_s"), r.get("p50_below_s"))),
        ("p99", fmt_latency(r.get("p99_s"), r.get("p99_below_s"))),
    ]
    t.append("router ", style="dim")
    for label, value in figures:
        t.append(f"{label} ", style="dim")
        t.append(f"{value}  ", style="bold")
    if r.get("latency_window") == "lifetime":
        t.append("(latency since start)  ", style="dim")
    for label, key in (("500s", "http_500"), ("no-backend", "no_backend")):
        value = r.get(key)
        t.append(f"{label} ", style="dim")
        t.append(f"{fmt_count(value)}  ", style="bold red" if value else "bold")
    t.append("serving ", style="dim")
    t.append(fmt_count(r.get("serving_backends")), style="bold")
    history = snap.get("history") or []
    n = (
        60
        if width is None
        else max(10, min(60, width - len("throughput   max 0000.0 req/s over the last 60 samples")))
    )
    shown = history[-n:]  # as many samples as fit one line: a wrapped chart costs a line of the frame
    line = sparkline(shown, n)
    if line:
        t.append("\nthroughput ", style="dim")
        t.append(line, style="green")
        t.append(f"  max {max(shown):.1f} req/s over the last {len(shown)} samples", style="dim")
    return t


def _cache_reset_line(reset: dict[str, Any]) -> Text:
    """When the fleet's prefix caches were last flushed (``rl-launch fleet reset-cache``) and whether
    every engine complied: a trainer that skipped it after a weight update shows as an old time here."""
    import time as _time

    engines = reset.get("engines") or []
    ok = sum(1 for e in engines if e.get("ok"))
    t = Text()
    t.append("cache reset ", style="dim")
    at = float(reset.get("at") or 0)
    t.append(_time.strftime("%H:%M:%S", _time.localtime(at)), style="bold")
    t.append(f" ({_time.time() - at:.0f} s ago)  ", style="dim")
    style = "green" if reset.get("ok") else "bold red"
    t.append(f"{ok}/{len(engines)} engines flushed", style=style)
    dropped = reset.get("router_entries_dropped")
    if dropped is not None:
        t.append(f", router index cleared ({dropped} entries)", style="dim")
    return t


def _gateway_line(snap: dict[str, Any]) -> Text:
    """The front's own view (``router.kind``), next to the controller's engine states below."""
    g = snap.get("gateway") or {}
    t = Text()
    t.append("gateway ", style="dim")
    t.append(str(g.get("kind") or "?"), style="bold")
    if g.get("final"):
        t.append("  stopped with the job", style="dim")
        return t
    if not g.get("reachable"):
        t.append(f"  unreachable: {g.get('detail') or '?'}", style="bold red")
        return t
    t.append("  routes to ", style="dim")
    t.append(f"{g.get('members', 0)}", style="bold")
    t.append(f" ({g.get('healthy', 0)} healthy by its own checks)", style="dim")
    extra = g.get("extra") or []
    if extra:
        t.append(f"  {len(extra)} the fleet does not know: {', '.join(extra[:3])}", style="yellow")
    return t


def _summary(snap: dict[str, Any]) -> Text:
    engines = snap.get("engines") or []
    t = Text()
    t.append(f"engines {len(engines)}", style="bold")
    if snap.get("engine_source") == "listing":
        t.append(" (no fleet-health state yet: HEALTHY? = listed, not judged)", style="dim")
    for state, n in sorted((snap.get("summary") or {}).items(), key=lambda kv: _SEVERITY.get(kv[0], 9)):
        t.append("  ")
        t.append(f"{n} {state}", style=STATE_STYLES.get(state, ""))
    budget = (snap.get("fleet") or {}).get("budget")
    if isinstance(budget, dict) and "run_used" in budget:
        t.append(f"  restarts {budget.get('run_used')}/{budget.get('run_total')} of the run's budget", "dim")
    return t


def _pick_rows(engines: list[dict[str, Any]], max_rows: int | None) -> list[dict[str, Any]]:
    """All rows, or at most ``max_rows`` with every troubled engine kept first (fleet order kept)."""
    if max_rows is None or len(engines) <= max_rows:
        return engines

    def trouble(e: dict[str, Any]) -> bool:
        return e.get("state") not in ("HEALTHY", "HEALTHY?") or e.get("reachable") is False

    troubled = sorted((e for e in engines if trouble(e)), key=lambda e: _SEVERITY.get(e.get("state", ""), 9))
    chosen = {id(e) for e in troubled[:max_rows]}
    for e in engines:
        if len(chosen) >= max_rows:
            break
        chosen.add(id(e))
    return [e for e in engines if id(e) in chosen]


ENGINE_COLUMNS = (
    ("id", "right"),
    ("node", "left"),
    ("url", "left"),
    ("state", "left"),
    ("restarts", "right"),
    ("in-flight", "right"),
    ("req/s", "right"),
    ("err", "right"),
    ("p50", "right"),
    ("hit", "right"),
    ("kv", "right"),
    ("run/wait", "right"),
    ("note", "left"),
)


def _engine_cells(e: dict[str, Any]) -> list[tuple[str, str]]:
    """One row as ``(text, style)`` cells, in ``ENGINE_COLUMNS`` order."""
    state = str(e.get("state") or "?")
    if e.get("reachable") is False:
        note = (f"unreachable: {e.get('error')}", "red")
    elif e.get("last_reason"):
        note = (str(e["last_reason"]), "dim")
    elif e.get("in_rotation") is False:
        note = ("not in the router's rotation", "dim yellow")
    elif e.get("in_gateway") is False and state == "HEALTHY":
        note = ("not in the gateway's view", "dim yellow")
    else:
        note = ("", "")
    err = e.get("error_rate")
    running, waiting = e.get("running"), e.get("waiting")
    return [
        (str(e.get("id", "")), ""),
        (str(e.get("node") or ""), ""),
        (str(e.get("url") or ""), ""),
        (state, STATE_STYLES.get(state, "")),
        (fmt_count(e.get("restarts")), ""),
        (fmt_count(e.get("in_flight")), ""),
        (fmt_num(e.get("req_per_s")), ""),
        (fmt_num(err * 100 if err is not None else None, ".1f", "%"), "red" if err else ""),
        (fmt_latency(e.get("p50_s"), e.get("p50_below_s")), ""),
        (fmt_num(e.get("prefix_hit_pct"), ".1f", "%"), ""),
        (fmt_num(e.get("kv_usage_pct"), ".1f", "%"), ""),
        ("-" if running is None and waiting is None else f"{fmt_count(running)}/{fmt_count(waiting)}", ""),
        note,
    ]


# Columns given up first when the terminal is too narrow for all of them (the note is cut, not dropped,
# while at least a few characters of it fit). id and state always stay: they say which engine (the id
# ``rl-launch logs --engine`` takes) and whether it serves.
DROP_ORDER = ("url", "run/wait", "kv", "in-flight", "hit", "restarts", "node", "err", "p50", "req/s", "note")
_GAP = 2
_MIN_NOTE = 12


def fit_columns(widths: dict[str, int], width: int | None) -> list[str]:
    """The columns (in ``ENGINE_COLUMNS`` order) that fit ``width`` cells, dropping by ``DROP_ORDER``."""
    names = [name for name, _ in ENGINE_COLUMNS]
    if width is None:
        return names

    def needed(cols: list[str]) -> int:
        fixed = [c for c in cols if c != "note"]
        total = sum(widths[c] for c in fixed) + _GAP * (len(fixed) - 1)
        if "note" in cols:
            total += _GAP + min(widths["note"], _MIN_NOTE)
        return total

    cols = list(names)
    for name in DROP_ORDER:
        if needed(cols) <= width:
            break
        cols.remove(name)
    return cols


def _engine_table(snap: dict[str, Any], max_rows: int | None, width: int | None = None) -> Text:
    """The engine rows as one pre-aligned ``Text``. Not a ``rich.table.Table``: with 256 engines a Table
    spends ~0.5 s measuring and wrapping 3,000 cells every frame, a plain aligned block ~20x less, and
    the live view redraws every second or two on a shared login node. With ``width``, columns are
    dropped by ``DROP_ORDER`` until the rest fits, instead of cutting every row at the edge."""
    engines = snap.get("engines") or []
    all_rows = [_engine_cells(e) for e in _pick_rows(engines, max_rows)]
    hidden = len(engines) - len(all_rows)
    names = [name for name, _ in ENGINE_COLUMNS]
    all_header = [(name, "bold dim") for name in names]
    measured = {
        name: max(cell_len(row[i][0]) for row in [all_header, *all_rows]) for i, name in enumerate(names)
    }
    keep = fit_columns(measured, width)
    index = [names.index(c) for c in keep]
    columns = [ENGINE_COLUMNS[i] for i in index]
    rows = [[row[i] for i in index] for row in all_rows]
    header = [all_header[i] for i in index]
    widths = [measured[c] for c in keep]
    out = Text(no_wrap=True, overflow="ellipsis")
    last = len(columns) - 1
    for n, row in enumerate([header, *rows]):
        if n:
            out.append("\n")
        for i, ((text, style), (_, justify), width_i) in enumerate(zip(row, columns, widths, strict=True)):
            if width is not None and i == last and columns[i][0] == "note":
                room = max(1, width - (sum(widths[:-1]) + _GAP * last))
                text = text if cell_len(text) <= room else text[: max(0, room - 1)] + "…"
            pad = " " * (width_i - cell_len(text))
            if i == last:
                out.append(text, style)
                continue
            if justify == "right":
                out.append(pad)
                out.append(text, style)
            else:
                out.append(text, style)
                out.append(pad)
            out.append("  ")
    if hidden:
        out.append(
            f"\n{hidden} more engine(s) not shown (troubled ones first); --json lists every one", "dim"
        )
    return out


def _event_cells(ev: dict[str, Any]) -> tuple[str, Text, str]:
    """``(time, what, detail)`` of one event. Two shapes share ``events.jsonl``: the driver's phases
    (``t``, ``phase``, ``detail``) and the fleet controller's state changes (``time``, ``engine_id``,
    ``from_state``, ``to_state``, ``reason``, ``level``); anything else still shows its time and keys."""
    t = ev.get("t", ev.get("time"))
    when = time.strftime("%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, int | float) else "-"
    to_state = str(ev.get("to_state") or ev.get("state") or "").upper()
    engine = ev.get("engine_id", ev.get("engine"))
    if ev.get("phase") or ev.get("kind") or ev.get("event"):
        what = str(ev.get("phase") or ev.get("kind") or ev.get("event"))
        if engine is not None:
            what = f"{what} [{engine}]"
    elif to_state:
        what = f"engine {engine}: {ev.get('from_state') or '?'} -> {to_state}"
    else:
        what = ", ".join(sorted(k for k in ev if k not in ("t", "time")))[:40] or "?"
    style = STATE_STYLES.get(to_state, "")
    level = ev.get("level")
    if ev.get("phase") == "failed" or level == "error":
        style = "bold red"
    elif level == "warning" and not style:
        style = "yellow"
    detail = str(ev.get("detail") or ev.get("reason") or "")
    return when, Text(what, style=style), detail


def _events(snap: dict[str, Any]) -> Table:
    table = Table(box=None, pad_edge=False, show_header=False, title="last events", title_justify="left")
    table.add_column("time", style="dim", no_wrap=True)
    table.add_column("what", no_wrap=True)
    table.add_column("detail")
    for ev in snap.get("events") or []:
        table.add_row(*_event_cells(ev))
    return table


def render_snapshot(
    snap: dict[str, Any], max_rows: int | None = None, width: int | None = None
) -> RenderableType:
    """The whole frame. ``max_rows`` caps the engine table (the live view passes what fits the
    terminal); ``None`` lists every engine (``--once``). ``width``: the terminal's columns, which the
    engine table fits by dropping its least important columns."""
    parts: list[RenderableType] = [_job_header(snap)]
    condition = snap.get("condition", "running")
    message = snap.get("message")
    if message:
        style = CONDITION_STYLES.get(condition, "yellow")
        result = snap.get("result") or {}
        if condition == "finished" and (result.get("exit_code") not in (0, None) or not result):
            style = "red"
        parts.append(Panel(Text(message, style=f"bold {style}"), border_style=style, expand=False))
    for problem in snap.get("problems") or []:
        parts.append(Text(f"! {problem}", style="yellow"))
    if condition in ("running", "unreachable") or (snap.get("router") or {}).get("reachable") is not None:
        parts.append(_router_line(snap, width))
    if snap.get("gateway"):
        parts.append(_gateway_line(snap))
    if snap.get("cache_reset"):
        parts.append(_cache_reset_line(snap["cache_reset"]))
    refit = snap.get("refit") or {}
    refit_text = refit_line(refit.get("pause"), refit.get("step"), refit.get("transaction"))
    if refit_text is not None and refit_text.plain:
        parts.append(refit_text)
    serving = sum(1 for e in snap.get("engines") or [] if e.get("state") in ("HEALTHY", "SUSPECT")) or None
    adapters = adapters_text(refit.get("adapters"), serving)
    if adapters is not None:
        parts.append(adapters)
    rollouts = rollouts_text(snap.get("rollouts"))
    if rollouts is not None:
        parts.append(rollouts)
    standing = standing_text(snap.get("standing"))
    if standing is not None:
        parts.append(standing)
    elastic = elastic_text(snap.get("elastic"))
    if elastic is not None:
        parts.append(elastic)
    if snap.get("engines"):
        parts.append(_summary(snap))
        parts.append(_engine_table(snap, max_rows, width))
    if snap.get("events"):
        parts.append(_events(snap))
    return Group(*parts)
