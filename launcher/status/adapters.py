"""The fleet's LoRA adapters on the dashboard: each tenant's adapter and version, and which engines hold it.

From ``GET /fleet/adapters`` at the job's ``fleet_url`` (``router.fleet.adapter_routes``; the admin token read
from the job directory, as the refit line's). On a shared fleet the question an operator asks is "which
team is on which version, and is any engine missing one": an engine that failed a load keeps serving the
others and takes none of that adapter's requests, so a fleet one engine short for one tenant only shows
here, not in the engine rows.
"""

from __future__ import annotations

import aiohttp
from rich.text import Text

from launcher.status.refit import fetch_admin_json


async def fetch_adapters(
    session: aiohttp.ClientSession, fleet_url: str, token: str, timeout_s: float
) -> dict[str, object] | None:
    """The router's adapter table, or None (no adapters served, a front without them, any error)."""
    got = await fetch_admin_json(session, fleet_url, "/fleet/adapters", token, timeout_s)
    return got if isinstance(got, dict) and "adapters" in got else None


def adapters_text(view: dict[str, object] | None, engines: int | None = None) -> Text | None:
    """One line per adapter (tenant, version, engines holding it, draining versions, a refit running or
    the last one's outcome), then the served names per engine. ``engines``: how many serve, to say which
    adapters some engine is missing."""
    if not view:
        return None
    adapters = view.get("adapters") or {}
    plan = view.get("plan") or {}
    assert isinstance(adapters, dict) and isinstance(plan, dict)
    t = Text()
    t.append(f"adapters {len(adapters)}/{plan.get('max_adapters', '?')}", style="bold")
    t.append(f" (rank <= {plan.get('max_lora_rank', '?')})", style="dim")
    active = view.get("active") or {}
    last = view.get("last") or {}
    assert isinstance(active, dict) and isinstance(last, dict)
    for name, a in sorted(adapters.items()):
        current = a.get("current") or {}
        held = len(current.get("engines") or [])
        t.append(f"\n  {name}", style="bold")
        t.append(f" [{a.get('owner')}]", style="dim")
        t.append(f" {a.get('version')!r}", style="bold green")
        short = engines is not None and held < engines
        t.append(
            f" on {held}{f'/{engines}' if engines is not None else ''} engine(s)",
            style="bold red" if short else "",
        )
        draining = a.get("draining") or []
        if draining:
            t.append(
                "  draining " + ", ".join(f"{d['version']} ({d['in_flight']} in flight)" for d in draining),
                style="dim",
            )
        t.append(f"  {a.get('requests', 0)} requests", style="dim")
        txn = active.get(name) or last.get(name)
        if txn:
            running = name in active
            word = (
                str(txn.get("phase")).upper()
                if running
                else ("ok" if txn.get("ok") else str(txn.get("phase")))
            )
            style = "bold yellow" if running else ("green" if txn.get("ok") else "bold red")
            t.append(
                f"  refit {txn.get('version')!r} {word} {float(txn.get('elapsed_s') or 0):.2f} s", style=style
            )
            if not running and txn.get("error"):
                t.append(f": {str(txn['error'])[:100]}", style="red")
    served = view.get("engines") or {}
    assert isinstance(served, dict)
    for url, names in sorted(served.items()):
        t.append(f"\n    {url}: ", style="dim")
        t.append(", ".join(names))
    return t
