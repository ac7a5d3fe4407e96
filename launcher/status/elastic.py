"""An elastic fleet on the dashboard: the generation nodes (serving, DRAINING with what is still in flight,
given back), each grow (queued with Slurm's reason, starting, joined), the tail policy's last decisions,
and the node-seconds held and given back.

Read from the ``elastic`` part of the job state, which the driver's elastic manager writes every second
(``launcher.fleet.elastic.shapes`` owns its shape); the node-seconds are recomputed at the moment of looking
while the job runs, and taken as written once it ended. Nothing here fails the dashboard: a state without
the section (a job before its fleet serves, an older job) shows nothing.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text

from launcher.fleet.elastic import shapes


def elastic_view(state: dict[str, Any], now: float) -> dict[str, Any] | None:
    """The ``elastic`` section for ``status --json``, with live node-seconds; None without one."""
    section = state.get("elastic")
    if not isinstance(section, dict):
        return None
    view = dict(section)
    if not section.get("final"):
        held, given = shapes.node_seconds(list(section.get("nodes") or []), now)
        view["node_seconds"] = {"held": round(held, 1), "given_back": round(given, 1)}
    nodes = section.get("nodes") or []
    view["counts"] = {
        state_name: sum(1 for n in nodes if n.get("state") == state_name)
        for state_name in (shapes.NODE_SERVING, shapes.NODE_DRAINING, shapes.NODE_RELEASED)
    }
    return view


def _interesting(view: dict[str, Any]) -> bool:
    """Worth a line: anything was resized, is being resized, or the tail policy is on."""
    counts = view.get("counts") or {}
    return bool(
        view.get("grows")
        or counts.get(shapes.NODE_DRAINING)
        or counts.get(shapes.NODE_RELEASED)
        or view.get("policy")
        or view.get("decisions")
    )


def elastic_text(view: dict[str, Any] | None) -> Text | None:
    """``elastic: N serving, M DRAINING, K given back; node-seconds ...`` and one line per grow, drain and
    recent decision; None when the fleet was never resized and has no tail policy."""
    if not view or not _interesting(view):
        return None
    counts = view.get("counts") or {}
    ns = view.get("node_seconds") or {}
    t = Text()
    t.append("elastic", style="bold")
    t.append(f": {counts.get(shapes.NODE_SERVING, 0)} node(s) serving")
    if counts.get(shapes.NODE_DRAINING):
        t.append(f", {counts[shapes.NODE_DRAINING]} DRAINING", style="yellow")
    if counts.get(shapes.NODE_RELEASED):
        t.append(f", {counts[shapes.NODE_RELEASED]} given back")
    t.append(f"; node-seconds held {ns.get('held', 0):.0f}, given back {ns.get('given_back', 0):.0f}")
    policy = view.get("policy")
    if policy:
        t.append(
            f"\n  tail policy: below {policy['shrink_below']:.0%} of capacity for {policy['for_s']:g} s -> "
            f"{policy['floor_nodes']} node(s)"
            + ("; grows back at the next step" if policy.get("grow_back") else "")
        )
    for n in view.get("nodes") or []:
        if n.get("state") == shapes.NODE_DRAINING:
            left = n.get("in_flight")
            t.append(
                f"\n  {n['name']} DRAINING for {n.get('draining_for_s', 0):.0f} s, "
                f"{'?' if left is None else left} request(s) in flight",
                style="yellow",
            )
    for g in view.get("grows") or []:
        if g.get("state") in shapes.GROW_FINAL and g.get("state") != shapes.GROW_FAILED:
            continue
        job = f" (Slurm job {g['job_id']})" if g.get("job_id") else ""
        line = f"\n  grow {g['id']}{job}: {g['nodes']} node(s) {g['state']}"
        if g.get("state") == shapes.GROW_PENDING and g.get("reason"):
            line += f" ({g['reason']})"
        elif g.get("detail"):
            line += f": {g['detail']}"
        t.append(line, style="red" if g.get("state") == shapes.GROW_FAILED else "")
    for d in (view.get("decisions") or [])[-3:]:
        outcome = f" -- refused: {d['refused']}" if d.get("refused") else ""
        t.append(f"\n  policy {d['op']} {d['nodes']}: {d['reason']}{outcome}")
    return t
