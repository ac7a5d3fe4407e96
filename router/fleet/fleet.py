"""``Fleet``: the one view of the engines that the ``/fleet/*`` code shares.

The admin routes (``router.fleet.api``), the refit routes (``router.fleet.refit_routes``), the refit
transaction (``router.fleet.refit``) and the restores (``router.fleet.restore``) all need the same few
things: the backend set, the engine key, how long an engine may take, the fleet's current weight version,
and one way to fan a call out to every engine and judge the answers. Before, these lived in ``FleetApi``:
the refit routes called its private helpers and the coordinator got callables pointing back into it, so
the modules formed a circle. Each of them now takes this view instead, and the imports run one way:
api -> refit_routes -> refit -> fleet.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from router.fleet.engine import EngineAnswer, EngineClient
from router.fleet.ops import FleetOpReport, fan_out
from router.state.backends import BackendSet

ENGINE_TIMEOUT_S = 120.0
"""How long one fleet operation waits for the engines' answers."""

EngineCall = Callable[[EngineClient, str], Awaitable[EngineAnswer]]
"""One call to one engine (``(client, url) -> answer``), fanned out by ``Fleet.fan``."""


class Fleet:
    """The engines behind one front (the router's, or the driver's fleet endpoint's)."""

    def __init__(
        self,
        backends: BackendSet,
        engine_key: str | None = None,
        engine_timeout_s: float = ENGINE_TIMEOUT_S,
    ) -> None:
        self.backends = backends
        self.engine_key = engine_key
        """The key every call to an engine presents (``router.fleet.engine``)."""
        self.engine_timeout_s = engine_timeout_s
        self.current_version: str | None = None
        """The fleet's weight version once a stamp or a refit set one (None before: every engine serves
        the checkpoint it was started from)."""

    async def fan(
        self, op: str, urls: list[str], call: EngineCall, timeout_s: float | None = None
    ) -> FleetOpReport:
        """``call`` on every engine of ``urls`` at once, judged into one report. ``timeout_s``: each
        engine's bound (a refit's step passes what its deadline leaves, a load can take minutes);
        ``None``: ``engine_timeout_s``."""
        t0 = time.monotonic()
        timeout = self.engine_timeout_s if timeout_s is None else timeout_s
        answers = await fan_out(urls, call, api_key=self.engine_key, timeout_s=timeout)
        return FleetOpReport(op, answers, took_s=round(time.monotonic() - t0, 4))

    def all_engines(self) -> list[str]:
        """Serving engines plus those held out as stale (they are paused and resumed like the rest)."""
        stale = self.backends.stale
        return [u for u in self.backends.members if u in stale or u in self.backends.serving]

    @staticmethod
    async def read_body(request: web.Request) -> dict[str, Any]:
        """An admin call's JSON body: ``{}`` when empty, ``ValueError`` when it is not an object."""
        raw = await request.read()
        if not raw:
            return {}
        data = orjson.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("body must be a JSON object")
        return data
