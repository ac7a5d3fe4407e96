"""The current step's rollouts on the dashboard: the figures of ``launcher.record.view`` as rich text."""

from __future__ import annotations

from typing import Any

from rich.text import Text

from launcher.status.charts import sparkline


def rollouts_text(view: dict[str, Any] | None) -> Text | None:
    if not view:
        return None
    tl = view["timeline"]
    t = Text()
    t.append("rollouts ", style="bold")
    t.append(
        f"{view['sessions']} sessions, {view['requests']} requests over {view['end'] - view['start']:.1f} s; "
        f"90% of sessions done at {tl['t90_s']:.1f} s, the tail is {100 * tl['tail_share']:.0f}% of the "
        "step\n"
    )
    t.append(f"  in flight  {sparkline(tl['in_flight'])}  (peak {max(tl['in_flight'])})\n")
    t.append(f"  finished   {sparkline(tl['sessions_finished'])}\n")
    if view["slowest"]:  # a short terminal shows none of them (launcher.status.fit): no header either
        t.append(
            "  slowest sessions (span: held / first byte / decode / between turns; engines)\n", style="dim"
        )
    for s in view["slowest"]:
        p = s["phases_s"]
        engines = " > ".join(e.split("//")[-1].removesuffix("/v1") for e in s["engines"]) or "-"
        versions = f" v{','.join(s['versions'])}" if s["versions"] else ""
        failed = f" {s['failed']} failed" if s["failed"] else ""
        t.append(
            f"  {s['session'][:16]:16} {s['span_s']:7.1f}s {s['turns']:3d} turns  "
            f"{p['held']:.1f}/{p['first_byte']:.1f}/{p['decode']:.1f}/{p['between_turns']:.1f}s  "
            f"{engines}{versions}{failed}\n"
        )
    t.rstrip()
    return t
