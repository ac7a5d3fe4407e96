"""The refit window on the dashboard: the refit transaction's steps, pause, held requests, stale engines,
and the current step's figures.

A trainer that paused the fleet and never resumed looks, from Gym's side, like a hang; an engine left
stale looks like a fleet one engine short. Both are one line here. The pause figures come from the
router's ``/metrics`` (``router.state.metrics``' pause collector); the step's figures from ``GET /fleet/step``
at the job's ``fleet_url`` (admin token, read from the job directory; never sent anywhere else, see
``launcher.status.collect``), i.e. the engines' own counters since the trainer's last ``begin_step``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from rich.text import Text

from launcher.net.http_call import bearer
from router.prometheus import metric_sum, parse_metrics

_GAUGES = {
    "paused": "rl_router_fleet_paused",
    "held": "rl_router_held_requests",
    "longest_wait_s": "rl_router_held_longest_wait_seconds",
    "last_pause_s": "rl_router_last_pause_seconds",
    "last_pause_max_wait_s": "rl_router_last_pause_max_wait_seconds",
    "stale": "rl_router_stale_backends",
    "pauses": "rl_router_pauses_total",
    "refused": "rl_router_held_refused_total",
}


def pause_view(router_metrics: str | None) -> dict[str, Any] | None:
    """The pause figures from the router's ``/metrics`` text (None: not our router, or no answer)."""
    if not router_metrics:
        return None
    m = parse_metrics(router_metrics, ("rl_router_",))
    view = {k: metric_sum(m, name) for k, name in _GAUGES.items()}
    return view if view["paused"] is not None else None


async def fetch_step(session: aiohttp.ClientSession, fleet_url: str, token: str, timeout_s: float) -> Any:
    """``GET /fleet/step`` at the job's own ``fleet_url`` (None when no step was begun, or on any error,
    a redirect included, which is never followed: the dashboard never fails)."""
    return await fetch_admin_json(session, fleet_url, "/fleet/step", token, timeout_s)


async def fetch_refit(session: aiohttp.ClientSession, fleet_url: str, token: str, timeout_s: float) -> Any:
    """``GET /fleet/refit``: the refit transaction running now and the last one (``router.fleet.refit``
    owns the shape), or None on any error."""
    return await fetch_admin_json(session, fleet_url, "/fleet/refit", token, timeout_s)


async def fetch_admin_json(
    session: aiohttp.ClientSession, fleet_url: str, path: str, token: str, timeout_s: float
) -> Any:
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(
                f"{fleet_url.rstrip('/')}{path}", headers=bearer(token), allow_redirects=False
            ) as resp:
                if resp.status not in (200, 500):
                    return None
                return await resp.json()
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
        return None


def transaction_text(state: dict[str, Any] | None) -> Text | None:
    """The refit transaction: while it runs, its phase and each step so far; after it, how it ended."""
    if not state:
        return None
    txn = state.get("active") or state.get("last")
    if not txn:
        return None
    t = Text()
    running = state.get("active") is not None
    t.append(f"refit {txn.get('version')!r} ", style="bold")
    phase = str(txn.get("phase"))
    style = "bold yellow" if running else ("bold green" if txn.get("ok") else "bold red")
    t.append(phase.upper() if running else phase, style=style)
    t.append(f" {float(txn.get('elapsed_s') or 0):.2f} s", style="dim")
    steps = txn.get("steps") or []
    if steps:
        t.append("  " + " > ".join(f"{s['phase']} {float(s['took_s']):.2f}s" for s in steps), style="dim")
    if running and txn.get("lease_left_s") is not None:
        t.append(f"  lease {float(txn['lease_left_s']):.0f} s left", style="dim")
    engines = txn.get("engines") or {}
    verified = len(txn.get("verified") or [])
    t.append(f"  {verified}/{len(engines)} verified", style="bold")
    for url, why in (txn.get("quarantined") or {}).items():
        t.append(f"  OUT {url}: {str(why)[:80]}", style="bold red")
    return t


def refit_line(
    pause: dict[str, Any] | None, step: dict[str, Any] | None, transaction: dict[str, Any] | None = None
) -> Text | None:
    txn_text = transaction_text(transaction)
    if not pause and not step and txn_text is None:
        return None
    t = Text()
    if txn_text is not None:
        t.append_text(txn_text)
        t.append("  ")
    if pause:
        if pause.get("paused"):
            t.append("fleet PAUSED ", style="bold yellow")
            t.append(f"{int(pause.get('held') or 0)} held", style="bold")
            t.append(f", longest wait {float(pause.get('longest_wait_s') or 0):.1f} s  ", style="dim")
        elif pause.get("pauses"):
            t.append("last pause ", style="dim")
            t.append(f"{float(pause.get('last_pause_s') or 0):.2f} s", style="bold")
            wait = float(pause.get("last_pause_max_wait_s") or 0)
            t.append(f" (longest held wait {wait:.2f} s)  ", style="dim")
        if pause.get("refused"):
            t.append(f"{int(pause['refused'])} refused past the pause bounds  ", style="bold red")
        if pause.get("stale"):
            t.append(f"{int(pause['stale'])} STALE engine(s) awaiting refit  ", style="bold red")
    if step and "fleet" in step:
        f = step["fleet"]
        t.append(f"step {step.get('step')} ", style="dim")
        t.append(f"({float(step.get('seconds') or 0):.0f} s) ", style="dim")
        prompt, gen = f.get("prompt_tokens", 0), f.get("generation_tokens", 0)
        t.append(f"prompt {prompt:,} gen {gen:,} tok", style="bold")
        rate = step.get("prefix_hit_rate")
        if rate is not None:
            t.append(f"  prefix hit {rate:.0%}", style="bold")
        finished = {k[9:]: v for k, v in f.items() if k.startswith("finished_")}
        if finished:
            t.append("  finished " + " ".join(f"{k} {v}" for k, v in sorted(finished.items())), style="dim")
        if f.get("preemptions"):
            t.append(f"  preemptions {f['preemptions']}", style="yellow")
        straddled = (step.get("straddled") or {}).get("count")
        if straddled:
            t.append(f"  {straddled} straddled a refit", style="yellow")
    return t
