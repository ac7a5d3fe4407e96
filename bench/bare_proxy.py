"""A bare aiohttp pass-through proxy: the reference point for bench/proxy_bench.py (not used in production).

The issue's figures quote "a bare aiohttp pass-through proxy ~3.3k req/s"; timing on a shared 2-core
machine swings by 30% or more between minutes, so the router is compared with this proxy measured in
the same run rather than with a number from another day.

    python bench/bare_proxy.py PORT BACKEND_URL
"""

from __future__ import annotations

import sys

import aiohttp
import uvloop
from aiohttp import web


def main() -> None:
    port, backend = int(sys.argv[1]), sys.argv[2]

    async def proxy(request: web.Request) -> web.Response:
        body = await request.read()
        session: aiohttp.ClientSession = request.app["session"]
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with session.post(backend + request.path, data=body, headers=headers) as upstream:
            payload = await upstream.read()
            return web.Response(body=payload, status=upstream.status, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def on_startup(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def on_cleanup(app: web.Application) -> None:
        await app["session"].close()

    app = web.Application()
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/chat/completions", proxy)
    app.router.add_post("/v1/completions", proxy)  # the Gym-shaped mode's streamed share
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
