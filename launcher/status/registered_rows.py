"""The dashboard's rows of engines the trainer registered (``generation.owner: trainer``), judged.

Their rows come from the listings the driver's gateway watcher writes (no fleet controller runs for them),
which say nothing of health: before, every such row read "HEALTHY?" and, being a member, ``in_gateway``,
even while the router held the engine out. Here each row takes the router's verdict
(``launcher.fleet.registered``): its state and reason, and ``in_gateway`` only while the router routes to
it.
"""

from __future__ import annotations

from typing import Any

from launcher.fleet.registered import judge_registered
from launcher.jobdir import GatewaySnapshot

JUDGED_SOURCE = "router"
"""``engine_source`` of rows judged here: by the router's probes, not listed only."""


def judge_registered_rows(
    rows: list[dict[str, Any]], gateway: GatewaySnapshot | None
) -> list[tuple[dict[str, Any], bool]]:
    """Give each row the router's verdict on its engine, in place; returns the rows judged, each with
    whether the router routes to it (for ``in_gateway``, once the gateway view has been drawn). Empty
    when there is no live view of the router to judge by (the rows stay as listed)."""
    judged = []
    for row in rows:
        verdict = judge_registered(row["url"], gateway) if row.get("url") else None
        if verdict is None:
            continue
        row["state"] = verdict.state
        row["last_reason"] = verdict.reason
        judged.append((row, verdict.in_rotation))
    return judged
