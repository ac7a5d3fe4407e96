"""The generation router: one stable URL in front of a fleet of vLLM (or vLLM-compatible) engines.

The server names are loaded on first use (PEP 562): importing the pure parts (``router.policies``,
``router.status``) for spec validation must not pull in aiohttp.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PROXIED_ROUTES", "GenerationRouter", "RouterBindError", "canonical_backend_url"]


def __getattr__(name: str) -> Any:
    if name == "canonical_backend_url":
        from router.backends import canonical_backend_url

        return canonical_backend_url
    if name in {"PROXIED_ROUTES", "GenerationRouter", "RouterBindError"}:
        import router.server

        return getattr(router.server, name)
    raise AttributeError(f"module 'router' has no attribute {name!r}")
