"""The refit window on the dashboard: pause, held requests, stale engines, and the current step's figures.

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

from launcher.http_call import bearer
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
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(
                f"{fleet_url.rstrip('/')}/fleet/step", headers=bearer(token), allow_redirects=False
            ) as resp:
                if resp.status not in (200, 500):
                    return None
                return await resp.json()
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
        return None


def refit_line(pause: dict[str, Any] | None, step: dict[str, Any] | None) -> Text | None:
    if not pause and not step:
        return None
    t = Text()
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
    return t
