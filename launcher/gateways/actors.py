"""Stopping a front that lives in a Ray actor restarted forever (``max_restarts=-1``)."""

from __future__ import annotations

from typing import Any


def stop_restartable_actor(actor: Any, timeout_s: float = 10.0) -> None:
    """Ask the actor to stop what it runs, then kill it for good (``no_restart``: a plain kill would have
    Ray restart it). Either step may find it gone already; the kill runs regardless."""
    import ray

    try:
        ray.get(actor.stop.remote(), timeout=timeout_s)
    except Exception:  # the actor may be gone already; it is killed below either way
        pass
    try:
        ray.kill(actor, no_restart=True)
    except Exception:
        pass
