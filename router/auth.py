"""Bearer tokens: one for clients on the proxied routes, a separate one for the ``/workers`` admin API.

Separate because the client key travels to every rollout worker (it is in Gym's config), while the admin
key can remove engines from rotation. ``/health``, ``/readiness`` and ``/metrics`` stay open, as vLLM's
do, so probes and scrapers need no secret.

``/workers`` is never open by accident: the router is built with ``RouterConfig.admin_secret`` (the admin
token, else the client key), and ``RouterConfig`` refuses a non-loopback address with neither unless
``insecure_admin`` is set.

aiohttp decodes header bytes as UTF-8 with ``surrogateescape``, so a non-UTF-8 ``Authorization`` value
arrives as a ``str`` that cannot be encoded back: it is a wrong credential (401), never an exception
(a 500 with a traceback per request is an unauthenticated log flood, and 500 is a status clients retry).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from router.status import error_body

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = frozenset({"/health", "/readiness", "/metrics"})


def _bearer(request: web.Request) -> str | None:
    value = request.headers.get("Authorization", "")
    if value[:7].lower() == "bearer ":
        return value[7:].strip()
    return None


def _matches(given: str | None, expected: str) -> bool:
    # surrogateescape: aiohttp decodes non-UTF-8 header bytes to surrogates; they must compare unequal
    # (401), not raise (500 and a traceback per request).
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode())


def auth_middleware(
    api_key: str | None, admin_token: str | None
) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path in OPEN_PATHS:
            return await handler(request)
        if path == "/workers" or path.startswith(("/workers/", "/fleet/")):
            if admin_token is not None and not _matches(_bearer(request), admin_token):
                return web.Response(
                    status=401,
                    body=error_body("admin token required", "unauthorized", 401),
                    content_type="application/json",
                )
            return await handler(request)
        if api_key is not None and not _matches(_bearer(request), api_key):
            return web.Response(
                status=401,
                body=error_body("invalid or missing API key", "unauthorized", 401),
                content_type="application/json",
            )
        return await handler(request)

    return check
