"""The generation router: one stable URL in front of a fleet of vLLM (or vLLM-compatible) engines.

The server names are imported lazily: ``router.config`` and ``router.policies`` are imported by
``rl-launch validate`` and the spec loader, which must not pay for (or need) aiohttp.
"""

from __future__ import annotations

from typing import Any

from router.state.backends import canonical_backend_url

__all__ = ["PROXIED_ROUTES", "GenerationRouter", "RouterBindError", "RouterConfig", "canonical_backend_url"]


def __getattr__(name: str) -> Any:
    if name in ("PROXIED_ROUTES", "RouterBindError"):
        from router.http import app

        return getattr(app, name)
    if name == "GenerationRouter":
        from router.server import GenerationRouter

        return GenerationRouter
    if name == "RouterConfig":
        from router.config import RouterConfig

        return RouterConfig
    raise AttributeError(f"module 'router' has no attribute {name!r}")
