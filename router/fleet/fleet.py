"""``Fleet``: the one view of the engines that the ``/fleet/*`` code shares, and the fleet's facts.

The admin routes (``router.fleet.api``), the refit routes (``router.fleet.refit_routes``), the refit
transaction (``router.fleet.refit``), the adapter refit (``router.fleet.adapter_refit``) and the restores
(``router.fleet.restore``) all need the same few things: the backend set, the engine key, how long an
engine may take, the fleet's current weight version, one way to fan a call out to every engine and judge
the answers, and three facts about the fleet: where its served model is on disk (``served_root``), which
device its engines run on (``device``), and the one runner of checkpoint checks (``checks``); and each
engine's ``/server_info``, read once per serving period and kept (``server_infos``). Before, the
first lived in ``FleetApi`` (the refit routes called its private helpers, the coordinator got callables
pointing back into it: a circle), and the facts lived in the refit routes class, handed from there to the
restorer and the adapter refits: a transaction stood on a routes module (architecture review
2026-12-05, section 3b). Each of them now takes this view, and the imports run one way: the routes ->
the transactions -> fleet.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from router.fleet.checkpoint import CheckpointGuard
from router.fleet.engine import EngineAnswer, EngineClient
from router.fleet.ops import FleetOpReport, fan_out
from router.fleet.server_infos import ServerInfos, config_of
from router.state.backends import BackendSet

ENGINE_TIMEOUT_S = 120.0
"""How long one fleet operation waits for the engines' answers."""

EngineCall = Callable[[EngineClient, str], Awaitable[EngineAnswer]]
"""One call to one engine (``(client, url) -> answer``), fanned out by ``Fleet.fan``."""
FACTS_TIMEOUT_S = 15.0
"""How long a read of the served root waits for the engine's ``/v1/models``."""


def device_of(config: dict[str, Any]) -> str:
    """The engine's device from its ``/server_info`` config (vLLM 0.32: ``device_config.device``, e.g.
    ``cpu``, ``cuda``; ``?`` when it says none)."""
    device = config.get("device_config")
    value = device.get("device") if isinstance(device, dict) else None
    return value if isinstance(value, str) and value else "?"


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
        self.checks = CheckpointGuard()
        """Runs every checkpoint check (a refit's before its pause, a restore's, an adapter load's) off the
        loop under its deadline, one at a time: one stalled mount holds one thread, not one per caller."""
        self.server_infos = ServerInfos(backends, engine_key)
        """Each serving engine's ``/server_info``, kept once read (vLLM's first answer waits for its
        environment to be collected: seconds)."""
        self._device: str | None = None

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

    async def served_root(self) -> str | None:
        """Where the engines loaded the served model from (the first engine's ``/v1/models`` root: an
        absolute directory, or a hub name, which the check does not read), or None."""
        urls = list(self.backends.serving) or self.all_engines()
        if not urls:
            return None
        async with EngineClient.open(self.engine_key, FACTS_TIMEOUT_S) as engines:
            got = await engines.model_root(urls[0])
        return got.value

    async def device(self) -> str | None:
        """The device the engines run on (``device_of`` the first serving engine's ``/server_info``; read
        once, since a fleet does not change device), or None while no engine says."""
        if self._device is None:
            urls = list(self.backends.serving)
            if not urls:
                return None
            config = config_of(await self.server_infos.of(urls[0], "json"))
            if config is None:
                return None
            self._device = device_of(config)
        return self._device

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
