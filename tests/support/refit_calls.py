"""What a refit test sends through the router, and what it reads back from the simulated engines.

``chat()`` is a short completion body, ``send`` posts it to a router, ``admin`` calls a router route with
the admin token ``TOKEN``, ``in_thread`` runs the (synchronous, a trainer's) ``FleetClient`` off the test's
event loop, and ``checksums`` reads each simulated engine's weight checksums.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

TOKEN = "admin-test-token-1234"
CHAT = "/v1/chat/completions"


def chat(max_tokens: int = 8, content: str = "hello there") -> dict[str, Any]:
    return {
        "model": "sim",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }


async def send(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + CHAT, json=body, headers=headers or {}) as r:
        return r.status, orjson.loads(await r.read())


async def admin(url: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as s, s.request(method, url + path, json=body, headers=headers) as r:
        return r.status, orjson.loads(await r.read())


def in_thread(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """The client is synchronous (a trainer's); run it off the test's loop, which serves the sims."""
    return asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kw))


def checksums(engines: list[Any]) -> list[dict[str, str]]:
    return [e.rl.checksums() for e in engines]
