"""A standing fleet on the dashboard: who is attached, each consumer's requests, tokens and share of the
fleet's in-flight capacity, and the fleet's current weight version (what a resubmitted trainer refits
from); for a job attached to a fleet, which fleet and as which consumer.

The consumers' figures come from ``GET /fleet/consumers`` at the fleet's ``fleet_url`` with its admin token
(``router.fleet``'s route owns the shape); the version from ``GET /fleet/refit``'s transactions when one
ran, else ``GET /fleet/weight_version``. Any failure is None: the dashboard never fails.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from rich.text import Text

from launcher.status.refit import fetch_admin_json


async def fetch_consumers(
    session: aiohttp.ClientSession, fleet_url: str, token: str, timeout_s: float
) -> Any:
    return await fetch_admin_json(session, fleet_url, "/fleet/consumers", token, timeout_s)


async def fetch_version(session: aiohttp.ClientSession, fleet_url: str, token: str, timeout_s: float) -> Any:
    got = await fetch_admin_json(session, fleet_url, "/fleet/weight_version", token, timeout_s)
    if isinstance(got, dict):
        return (got.get("result") or {}).get("current")
    return None


def standing_text(view: dict[str, Any] | None) -> Text | None:
    """``fleet NAME: version V, capacity C; consumer lines`` or ``attached to fleet NAME as X``."""
    if not view:
        return None
    t = Text()
    if view.get("attached_to"):
        a = view["attached_to"]
        t.append(f"attached to standing fleet {a.get('fleet')!r}", style="bold")
        t.append(f" as consumer {a.get('consumer')} (weight {a.get('weight')}")
        t.append(", may refit)" if a.get("admin") else ")")
        return t
    t.append(f"standing fleet {view.get('name')!r}", style="bold")
    t.append(f": version {view.get('version')!r}")
    consumers = view.get("consumers")
    if not isinstance(consumers, dict):
        t.append("; consumers: ?")
        return t
    t.append(f", in-flight capacity {consumers.get('capacity')}")
    rows = consumers.get("consumers") or {}
    if not rows:
        t.append("; no job attached")
    for name, c in sorted(rows.items()):
        share = c.get("share")
        t.append(
            f"\n  {name}: weight {c.get('weight')}{' admin' if c.get('admin') else ''}, "
            f"in flight {c.get('in_flight')}, waiting {c.get('waiting')}, requests {c.get('requests')}, "
            f"tokens {c.get('completion_tokens')}, share "
            + (f"{100 * share:.0f}%" if isinstance(share, int | float) else "-")
        )
    return t
