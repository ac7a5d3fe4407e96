"""The text of ``rl-launch list``: one aligned block that fits the terminal, with every job id whole.

The id is what ``status``, ``logs`` and ``cancel`` take, so it is never cut: a ``rich`` table shrank
every column to fit (ids cut after 36 characters, phases shown as "…", two columns at zero width) and,
piped, drew 200 columns whatever ``COLUMNS`` said. Here the id and the phase always show whole; the
other columns are added by ``PRIORITY`` while they fit, and a detail that does not fit its column goes
whole on a line of its own under its job, where a lost job's "rl-launch cancel X ends what it left" can
be read. When an id and its phase cannot share a line, each id takes a line of its own and the rest of
its row follows, indented.
"""

from __future__ import annotations

import os
import shutil
import textwrap
import time
from typing import Any

from rich.cells import cell_len
from rich.text import Text

COLUMNS = ("job", "slurm", "phase", "fleet", "front", "engines", "router", "updated", "detail")
"""Left to right, as shown when everything fits."""
PRIORITY = ("slurm", "updated", "engines", "detail", "front", "router", "fleet")
"""The optional columns, most wanted first: added while the line still fits (the detail counted at
``MIN_DETAIL`` cells; it gets whatever room the others leave)."""
GAP = 2
MIN_DETAIL = 20
"""Below this many cells a detail column is not worth drawing: every detail goes under its job."""
INDENT = 2


def terminal_width() -> int | None:
    """``COLUMNS`` when set (piped output honours it), the terminal's width on a terminal, else None:
    piped without ``COLUMNS``, each job is one line however long (for grep)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if os.isatty(1):
        return shutil.get_terminal_size().columns
    return None


def fleet_cell(row: dict[str, Any]) -> str:
    if row.get("fleet"):
        n = len(row.get("consumers") or [])
        return f"fleet {row['fleet']} ({n} attached)"
    return f"-> {row['attached_to']}" if row.get("attached_to") else "-"


def cells(row: dict[str, Any]) -> dict[str, str]:
    """One job (``job_summary``) as the text of each column."""
    updated = row.get("updated") or row.get("submitted")
    lines = [" ".join(line.split()) for line in str(row.get("detail") or "").splitlines()]
    detail = "\n".join(line for line in lines if line)  # a failure's log lines stay lines
    return {
        "job": row["job"],
        "slurm": str(row.get("slurm") or "-"),
        "phase": str(row.get("phase") or "-"),
        "fleet": fleet_cell(row),
        "front": str(row.get("front") or "-"),
        "engines": str(row.get("engines") or "-"),
        "router": str(row.get("router_url") or "-"),
        "updated": time.strftime("%m-%d %H:%M:%S", time.localtime(updated)) if updated else "-",
        "detail": detail,
    }


def choose_columns(widths: dict[str, int], width: int | None, first: int) -> list[str]:
    """The optional columns that fit in ``width`` after ``first`` cells, by ``PRIORITY``."""
    chosen: list[str] = []
    used = first
    for name in PRIORITY:
        need = MIN_DETAIL if name == "detail" else widths[name]
        if width is None or used + GAP + need <= width:
            chosen.append(name)
            used += GAP + need
    return chosen


def render_jobs(rows: list[dict[str, Any]], width: int | None) -> Text:
    """The whole listing for a terminal of ``width`` cells (None: no limit)."""
    table = [cells(r) for r in rows]
    if width is None:  # one line a job, for grep
        table = [{**c, "detail": " | ".join(c["detail"].splitlines())} for c in table]
    empty = {name for name in COLUMNS if all(c[name] in ("-", "") for c in table)}
    widths = {name: max([cell_len(name)] + [cell_len(c[name]) for c in table]) for name in COLUMNS}
    stacked = width is not None and widths["job"] + GAP + widths["phase"] > width
    first = INDENT + widths["phase"] if stacked else widths["job"] + GAP + widths["phase"]
    optional = choose_columns(widths, width, first) if table else []
    keep = {"phase", *(n for n in optional if n not in empty)} | (set() if stacked else {"job"})
    shown = [n for n in COLUMNS if n in keep and n != "detail"]
    used = sum(widths[n] for n in shown) + GAP * (len(shown) - 1) + (INDENT if stacked else 0)
    room = None if width is None else width - used - GAP
    detail_column = "detail" in keep
    if detail_column:
        shown.append("detail")
    out = Text(no_wrap=True)
    lead = " " * INDENT if stacked else ""
    if stacked:
        out.append("job\n", style="bold")
    out.append(lead + _line(shown, [widths[n] for n in shown]), style="bold")
    for c in table:
        if stacked:
            out.append("\n" + c["job"], style="bold")
        under = detail_column and room is not None and (cell_len(c["detail"]) > room or "\n" in c["detail"])
        values = [c[n] if not (n == "detail" and under) else "" for n in shown]
        out.append("\n" + lead + _line(values, [widths[n] for n in shown]))
        if c["detail"] and (under or not detail_column):
            out.append("\n" + under_job(c["detail"], width), style="dim")
    return out


def under_job(detail: str, width: int | None) -> str:
    """A detail on lines of its own, indented under its job (a failure's log lines each on its own);
    wrapped between words only, so an id in it (a lost job's "rl-launch logs X") stays whole."""
    lead = " " * 2 * INDENT
    if width is None:  # one line a job, for grep
        return lead + " | ".join(detail.splitlines())
    room = max(20, width - len(lead))
    lines = [
        wrapped
        for line in detail.splitlines()
        for wrapped in textwrap.wrap(line, room, break_long_words=False, break_on_hyphens=False)
    ]
    return "\n".join(lead + line for line in lines)


def _line(values: list[str], widths: list[int]) -> str:
    padded = [v + " " * (w - cell_len(v)) for v, w in zip(values[:-1], widths[:-1], strict=True)]
    return (" " * GAP).join([*padded, values[-1]]).rstrip()
