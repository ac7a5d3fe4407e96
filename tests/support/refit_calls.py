"""What a refit test sends through the router, and what it reads back from the simulated engines.

The fixture ``router_over`` (``router_over_fixture``) makes round-robin routers with the admin token
``TOKEN`` and no prober, ``chat()`` is a short completion body, ``send`` posts it to a router, ``admin``
calls a router route with the admin token, ``in_thread`` runs the (synchronous, a trainer's)
``FleetClient`` off the test's event loop, ``until`` polls a condition on it, and ``checksums`` reads each
simulated engine's weight checksums.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from router import GenerationRouter
from tests.support.http_backends import router_factory

TOKEN = "admin-test-token-1234"
CHAT = "/v1/chat/completions"


@pytest.fixture(name="router_over")
def router_over_fixture() -> Iterator[Callable[..., GenerationRouter]]:
    """The fixture ``router_over``: ``router_over(urls)`` is a round-robin router over ``urls`` with the
    admin token and no prober (the tests decide when an engine is looked at), stopped at the test's end.
    A module that uses it imports ``router_over_fixture`` (pytest finds it by its name)."""
    with router_factory(policy="round_robin", probe_interval_s=0, admin_token=TOKEN) as make_router:
        yield make_router


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


async def until(check: Any, timeout_s: float = 10.0) -> bool:
    """Poll ``check()`` every 50 ms for at most ``timeout_s``; whether it held."""
    for _ in range(int(timeout_s / 0.05)):
        if check():
            return True
        await asyncio.sleep(0.05)
    return bool(check())


def in_thread(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """The client is synchronous (a trainer's); run it off the test's loop, which serves the sims."""
    return asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kw))


def checksums(engines: list[Any]) -> list[dict[str, str]]:
    return [e.rl.checksums() for e in engines]
