"""A small read-only JSON status endpoint on the driver's node, next to the router's ``/metrics``.

``GET /status`` answers the job's current state (phase, router URL, the fleet snapshot with every
engine's health state and restarts); ``GET /events?n=50`` the last events. Scripts and dashboards that
cannot read the job directory (another cluster's login node, a monitoring system) get the same facts
over HTTP. No route changes anything, but the answers name every engine's address, and anyone on the
cluster reaches the node's address it binds: every request needs the job's client API key
(``Authorization: Bearer``, from ``secrets/api_key``), the least the facts are worth (a client of the
job reaches the engines with it anyway), not the admin token, which changes the fleet.

Served by a ``DriverListener`` (aiohttp on its own loop thread, with the router's head deadline and
connection cap): the stdlib server it replaces spent a thread on every connection and never timed one
out, so idle connections piled up as threads.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from launcher.jobdir import JobDir
from launcher.net.listener import LISTENER_LIMITS, DriverListener
from router.http.auth import Access, Credentials, RouteTable
from router.http.limits import HttpLimits


def parse_count(raw: str) -> int | None:
    """``n`` of ``/events?n=``: a positive integer, else None (answered 400; ``n=0`` used to return every
    event, and ``n=abc`` closed the connection from inside the handler)."""
    raw = raw.strip()
    if not raw.isdigit() or len(raw) > 9:
        return None
    n = int(raw)
    return n if n > 0 else None


class StatusServer:
    def __init__(self, job: JobDir, host: str, port: int, limits: HttpLimits = LISTENER_LIMITS) -> None:
        self.job = job
        self._api_key = job.read_api_key()  # no key file: no endpoint (it is never served open)
        if not self._api_key:
            raise ValueError(f"{job.api_key_file} is empty: the status endpoint is never served open")
        self.listener = DriverListener("status-endpoint", host, port, limits)

    @property
    def url(self) -> str:
        return self.listener.url

    def start(self) -> StatusServer:
        self.listener.start(self._app)
        return self

    def stop(self) -> None:
        self.listener.stop()

    def _app(self) -> web.Application:
        app = web.Application()
        # The router's own route marks: each route is bound to its check here, and an unmarked route
        # keeps the app from starting. Every route takes the client key (the 404 too: it names none).
        routes = RouteTable(app, Credentials(self._api_key, None, self.listener.limits.body_timeout_s))
        routes.add("GET", "/status", self._status, Access.CLIENT)
        routes.add("GET", "/events", self._events, Access.CLIENT)
        routes.add("*", "/{tail:.*}", self._not_found, Access.CLIENT)
        return app

    async def _status(self, request: web.Request) -> web.Response:
        # Off the loop: a file read must not hold up the other connections' deadlines.
        return _json(200, await asyncio.to_thread(self.job.read_state))

    async def _events(self, request: web.Request) -> web.Response:
        raw = request.query.get("n", "50")
        n = parse_count(raw)
        if n is None:
            return _json(400, {"error": f"n must be a positive integer (got {raw[:40]!r})"})
        events = await asyncio.to_thread(self.job.read_events)
        return _json(200, {"events": events[-n:]})

    async def _not_found(self, request: web.Request) -> web.Response:
        return _json(404, {"error": f"{request.path[:200]} not found; try /status or /events?n=50"})


def _json(status: int, payload: object) -> web.Response:
    return web.Response(status=status, text=json.dumps(payload, default=str), content_type="application/json")
