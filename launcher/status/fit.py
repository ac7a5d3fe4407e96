"""One dashboard frame that fits the terminal's height: the engine table and the events keep their room.

The live view redraws one frame in place; a frame taller than the terminal is cut by ``rich.live`` to
its first lines and a "...". At 80x24 that cut the engine table and the events to a single "...", while
the rollouts' "slowest sessions" list (8 rows) kept the screen: the engines' rows were counted against a
fixed guess of the other lines, which wrapped lines at 80 columns and the rollouts' block overran. Here
the frame is measured as rich draws it and the flexible parts share what the fixed part leaves, in
order of need: a few engine rows (troubled ones first: ``render._pick_rows``) and the last few events,
the rollouts' summary, then every engine row, every event, and the slowest sessions last.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, replace
from typing import Any

from rich.console import Console, RenderableType

from launcher.status.render import _events, render_snapshot
from launcher.status.rollouts import rollouts_text

MIN_ROWS = 4
MIN_EVENTS = 3


@dataclass(frozen=True)
class Plan:
    """How much of each flexible part a frame shows."""

    rows: int
    events: int
    slowest: int
    rollouts: bool


def _trimmed(snap: dict[str, Any], plan: Plan) -> dict[str, Any]:
    view = snap.get("rollouts")
    events = snap.get("events") or []
    return {
        **snap,
        "events": events[len(events) - plan.events :] if plan.events else [],  # the newest are last
        "rollouts": {**view, "slowest": view["slowest"][: plan.slowest]} if view and plan.rollouts else None,
    }


def plan_frame(snap: dict[str, Any], width: int, height: int) -> Plan:
    """The most of each part, in order of need, that keeps the frame within ``height`` lines.

    The frame is drawn once, with the fewest rows; the parts' heights are then added up (a ``Group``'s
    lines are its parts' lines): the engine table is one line a row, and the events and the rollouts are
    drawn alone (they wrap). Drawing the whole frame for every candidate cost 0.7 s at 256 engines on a
    tall terminal, every redraw."""
    console = Console(width=width, height=height, file=io.StringIO(), color_system=None)
    n_rows = len(snap.get("engines") or [])
    n_events = len(snap.get("events") or [])
    view = snap.get("rollouts")
    n_slowest = len(view.get("slowest") or []) if view else 0

    def lines(renderable: Any) -> int:
        return 0 if renderable is None else len(console.render_lines(renderable, console.options, pad=False))

    def table(rows: int) -> int:  # header, rows, "N more engine(s) not shown"; no_wrap: one line each
        return 0 if not n_rows else 1 + rows + (rows < n_rows)

    def events(n: int) -> int:
        return lines(_events(_trimmed(snap, Plan(0, n, 0, False)))) if n else 0

    def rollouts(plan: Plan) -> int:
        return lines(rollouts_text(_trimmed(snap, plan)["rollouts"]))

    start = Plan(min(n_rows, MIN_ROWS), min(n_events, MIN_EVENTS), 0, bool(view))
    drawn = lines(render_snapshot(_trimmed(snap, start), max_rows=start.rows, width=width))
    fixed = drawn - table(start.rows) - events(start.events) - rollouts(start)

    def total(plan: Plan) -> int:
        return fixed + table(plan.rows) + events(plan.events) + rollouts(plan)

    plan = start
    for smaller in (  # the least needed goes first when even the minimum is too tall
        {"rollouts": False},
        {"events": min(n_events, 1)},
        {"rows": min(n_rows, 1)},
        {"events": 0},
    ):
        if total(plan) <= height:
            break
        plan = replace(plan, **smaller)
    plan = replace(plan, rows=max(plan.rows, min(n_rows, plan.rows + height - total(plan))))
    if plan.rows == n_rows and total(plan) > height:  # the hidden-rows line went with the last row
        plan = replace(plan, rows=n_rows - 1)
    for part, most in (("events", n_events), ("slowest", n_slowest if plan.rollouts else 0)):
        while (
            getattr(plan, part) < most
            and total(more := replace(plan, **{part: getattr(plan, part) + 1})) <= height
        ):
            plan = more
    return plan


def fitted_frame(snap: dict[str, Any], width: int, height: int) -> RenderableType:
    """The frame for a terminal of ``width`` x ``height`` (the live view's)."""
    plan = plan_frame(snap, width, height)
    return render_snapshot(_trimmed(snap, plan), max_rows=plan.rows, width=width)
