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

from launcher.status.render import render_snapshot

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
    """The most of each part, in order of need, that keeps the frame within ``height`` lines."""
    console = Console(width=width, height=height, file=io.StringIO(), color_system=None)
    n_rows = len(snap.get("engines") or [])
    n_events = len(snap.get("events") or [])
    view = snap.get("rollouts")
    n_slowest = len(view.get("slowest") or []) if view else 0

    def lines(plan: Plan) -> int:
        frame = render_snapshot(_trimmed(snap, plan), max_rows=plan.rows, width=width)
        return len(console.render_lines(frame, console.options, pad=False))

    plan = Plan(min(n_rows, MIN_ROWS), min(n_events, MIN_EVENTS), 0, bool(view))
    for smaller in (  # the least needed goes first when even the minimum is too tall
        {"rollouts": False},
        {"events": min(n_events, 1)},
        {"rows": min(n_rows, 1)},
        {"events": 0},
    ):
        if lines(plan) <= height:
            break
        plan = replace(plan, **smaller)
    for part, most in (("rows", n_rows), ("events", n_events), ("slowest", n_slowest)):
        if part == "slowest" and not plan.rollouts:
            continue
        low, high = getattr(plan, part), most  # the largest count that fits, by bisection
        while low < high:
            mid = (low + high + 1) // 2
            if lines(replace(plan, **{part: mid})) <= height:
                low = mid
            else:
                high = mid - 1
        plan = replace(plan, **{part: low})
    return plan


def fitted_frame(snap: dict[str, Any], width: int, height: int) -> RenderableType:
    """The frame for a terminal of ``width`` x ``height`` (the live view's)."""
    plan = plan_frame(snap, width, height)
    return render_snapshot(_trimmed(snap, plan), max_rows=plan.rows, width=width)
