"""The dashboard's engine rows and gateway view, from what the job directory says about the fleet.

The rows come from the fleet controller's snapshot (``FleetSnapshot``) once it has written one, else
from the engine listings, with a state nobody has judged: a job whose controller has not ticked yet (or
a front that owns its engines) still shows its engines. The collector then fills each row with the
scrapes' figures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launcher.jobdir import STOPPED, FleetSnapshot, GatewaySnapshot, JobDir, engine_id
from launcher.status.samples import canonical_url

# Engine states the fleet-health controller writes; "HEALTHY?" marks an engine whose health nobody has
# judged (no controller state yet): it is listed from engines/node-*.urls.json and only looks healthy.
UNKNOWN_STATE = "HEALTHY?"

EXPECTED_SILENT = frozenset({"DEAD", "RETIRED", "RESTARTING"})


def listed_engines(job_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Engines from the engine listings in fleet order (numeric node order, then engine index: the
    order ``rl-launch logs --engine N`` counts), with the ids ``logs --engine`` takes (``node0-1``) and
    an unknown state, plus the start errors those listings record."""
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    for listing in JobDir(job_dir).listings():
        if listing.error:
            node = listing.node or f"generation node {listing.node_index}"
            problems.append(f"engines on {node} failed to start: {str(listing.error).strip()[:300]}")
        for e in sorted(listing.engines, key=lambda e: e.index):
            if not (e.url or e.api_url):
                continue
            rows.append(
                {
                    "id": engine_id(listing.node_index, e.index),
                    "node": e.node or listing.node,
                    "url": e.url or e.api_url,
                    "state": UNKNOWN_STATE,
                    "restarts": 0,
                    "last_reason": "",
                }
            )
    return rows, problems


def fleet_engines(
    fleet: FleetSnapshot | None, job_dir: Path | None
) -> tuple[list[dict[str, Any]], str, list[str]]:
    """The engine rows: the fleet controller's (``fleet``) when it has written them, else the engine
    listings with state ``HEALTHY?``. Returns ``(rows, source, problems)``."""
    if fleet is not None and fleet.engines is not None:
        rows = [
            {
                "id": e.id,
                "node": e.node,
                "url": e.url,
                "state": (e.state or UNKNOWN_STATE).upper(),
                "restarts": e.restarts,
                "last_reason": e.last_reason,
            }
            for e in fleet.engines
        ]
        problems = listed_engines(job_dir)[1] if job_dir is not None else []
        if fleet.fatal:
            problems.insert(0, f"fleet: {fleet.fatal}")
        return rows, "fleet", problems
    if job_dir is None:
        return [], "none", []
    rows, problems = listed_engines(job_dir)
    return rows, "listing", problems


def final_rows(engines: list[dict[str, Any]]) -> None:
    """A finished job serves nothing: every engine row says STOPPED (keeping the state the fleet
    controller last saw in ``state_at_end``), whether or not the driver lived to write the final
    snapshot itself."""
    for e in engines:
        if e["state"] != STOPPED:
            e.setdefault("state_at_end", e["state"])
            e["state"] = STOPPED


def gateway_view(view: GatewaySnapshot | None, engines: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The front's own view of the fleet (written by the fleet controller), beside ours: each engine row
    gets ``in_gateway`` (does the front route to it?), and the view lists what the front routes to that
    the fleet does not know (``extra``)."""
    if view is None:
        return None
    keys = {canonical_url(m.url) for m in view.members}
    ours = set()
    for row in engines:
        key = canonical_url(row["url"]) if row.get("url") else ""
        ours.add(key)
        row["in_gateway"] = (key in keys) if key and view.reachable else None
    return {
        "kind": view.kind,
        "base_url": view.base_url,
        "reachable": view.reachable,
        "detail": view.detail,
        "final": view.final,
        "members": len(view.members),
        "healthy": sum(1 for m in view.members if m.healthy is True),
        "extra": sorted(k for k in keys if k not in ours),
    }
