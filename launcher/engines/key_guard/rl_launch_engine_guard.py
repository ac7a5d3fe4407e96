"""ASGI middleware for vLLM's OpenAI server: the job's API key on every route but ``/health``.

Why: vLLM checks ``--api-key`` / ``VLLM_API_KEY`` only on paths under ``/v1``, ``/v2``, ``/inference`` and
``/cohere``. Everything else answers anyone who can reach the node: ``/metrics``, ``/tokenize``, and with
``VLLM_SERVER_DEV_MODE=1`` (which the refit window needs) ``/pause``, ``/abort_requests``,
``/update_weight_version``, ``/reset_prefix_cache``, the weight-transfer routes and ``/collective_rpc``,
which calls any method on the engine's workers. On a shared cluster any user on any node can reach an
engine's port, so the launcher adds this middleware (``--middleware``) to every engine it starts with a
key: a request without ``Authorization: Bearer <key>`` gets 401 before vLLM sees it, whatever the route,
including routes a later vLLM adds. ``/health`` stays open: probes (the fleet controller, Ray Serve's
health check, vllm-router's worker check) need no secret, and it tells nothing but "alive".

The key is read from ``VLLM_API_KEY`` in the engine's environment (where the launcher puts it: never
argv). Without one the middleware refuses to build, and vLLM fails at start instead of serving open.
Compared as SHA-256 digests with ``hmac.compare_digest``: no timing hint of the key's length or prefix.

Standard library only: this file is imported by the engine's interpreter, which has no rl-launch.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

GUARD_IMPORT_PATH = "rl_launch_engine_guard.EngineKeyGuard"
KEY_ENV = "VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})
"""Served without the key. Compared exactly: ``//health`` or ``/health/`` take the key (fail closed)."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

_UNAUTHORIZED = b'{"error":"Unauthorized"}'


def needs_key(path: str) -> bool:
    return path not in OPEN_PATHS


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


def authorized(header: str | None, key: str) -> bool:
    """Whether an ``Authorization`` header value carries ``Bearer <key>`` (scheme case-insensitive)."""
    if not header:
        return False
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(_digest(given.strip()), _digest(key))


class EngineKeyGuard:
    """``app.add_middleware(EngineKeyGuard)``: what vLLM's ``--middleware`` does with a class."""

    def __init__(self, app: App) -> None:
        key = os.environ.get(KEY_ENV, "")
        if not key:
            raise RuntimeError(
                f"{GUARD_IMPORT_PATH}: {KEY_ENV} is not set; refusing to serve the engine without its key"
            )
        self.app = app
        self._key = key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind not in ("http", "websocket"):  # lifespan: nothing to guard
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", ""))
        root = str(scope.get("root_path", "") or "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        if not needs_key(path) or authorized(self._header(scope), self._key):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})

    @staticmethod
    def _header(scope: Scope) -> str | None:
        """The first ``Authorization`` header (as vLLM's own check reads it); bytes as latin-1."""
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                return bytes(value).decode("latin-1")
        return None
